"""``n`` > 1: independent samples of one prompt.

The frontend splits such a request into n scheduler requests (``{rid}-{i}``), each with
``n`` = 1 and its own seed derived from the request's seed and the sample index, so a
seeded request is reproducible sample for sample. They share a ``prefix_group``: the
scheduler prefills the prompt once and the other samples take its KV from the radix cache.
A constrained request compiles its grammar once (the backends share in-flight compiles and
cache the result); every sample gets its own matcher.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from typing import AsyncIterator, Callable, Optional

from srt.transport.io_struct import TokenizedGenerateReq

_SEED_MASK = 2**63 - 1


def sample_seed(seed: Optional[int], index: int) -> Optional[int]:
    """Sample ``index``'s seed: the request's own for sample 0 (so n=1 and the first of n
    agree), a hash of (seed, index) for the others; None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def sample_rid(rid: str, index: int) -> str:
    return f"{rid}-{index}"


def split_samples(req: TokenizedGenerateReq) -> list[TokenizedGenerateReq]:
    """The scheduler requests for ``req``: itself when n == 1, else one per sample."""
    p = req.sampling_params
    if p.n == 1:
        return [req]
    return [dataclasses.replace(
        req, rid=sample_rid(req.rid, i), prefix_group=req.rid,
        sampling_params=dataclasses.replace(p, n=1, seed=sample_seed(p.seed, i)))
        for i in range(p.n)]


async def merge_samples(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave the samples' output streams as (index, output), in arrival order.
    Closing this generator closes every stream (which aborts unfinished samples)."""
    if len(streams) == 1:  # the common case: no task and queue hop per token
        async with contextlib.aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    await queue.put((i, out))
        except Exception as e:  # surfaces in the consumer, not lost in a task
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def combine_usage(outputs: list[dict], key: Callable[[dict], dict] = lambda o: o["meta_info"]) -> dict:
    """Token counts of n samples: the prompt once, every sample's completion tokens."""
    metas = [key(o) for o in outputs]
    return {"prompt_tokens": metas[0]["prompt_tokens"],
            "completion_tokens": sum(m["completion_tokens"] for m in metas),
            "cached_tokens": metas[0].get("cached_tokens", 0)}
