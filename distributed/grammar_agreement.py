"""The one agreement point for grammar compiles: which queued requests every rank of a TP
group may schedule (ready on all ranks) and which it must abort (failed on any rank).

Each rank reports indices into its grammar queue, which is identical on every rank (same
requests, same order), so the indices mean the same requests everywhere.

Wire format: one bitmap of int64 words, reduced with a single bitwise-AND all_reduce over
the TP CPU group (gloo). Bit 0 says "this rank failed nothing and every ready index of it
fits in the bitmap"; bit i + 1 says "queue position i is ready here". The AND is the
intersection of the ready sets, and its bit 0 tells every rank at once whether some rank
failed something. Only then -- rarely: the frontend pre-validates grammars, failures are
cached, a timeout ends a request once -- do the ranks run the previous exchange
(all_gather_object of ready lists and messages): the union, the lowest rank's message
winning, exactly as before. A gloo all_reduce pays for every extra element (up to 2 x
group size segments; past 2 elements at TP=4 on 2 CPUs it jumps from ~0.5 to ~4 ms), so
one bit per position: one word holds a queue of up to 63.

Not folded into another collective: the request broadcast before it is one-to-all, and
the previous step's token agreement would see the queue before that iteration's new
requests and idle wait, so a compile would take effect one iteration later.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup

logger = logging.getLogger(__name__)

FAST = 1  # bit 0: no failure here and every ready index fits
WORD_BITS = 64


def bitmap_words(queue_len: Optional[int]) -> int:
    """int64 words for a queue of ``queue_len`` (identical on every rank, so every rank
    sends the same shape). Padded to whole words: the shape changes only every 64
    positions. Unknown length: one word (63 positions); larger indices take the slow path."""
    if queue_len is None:
        return 1
    return max(1, -(-(queue_len + 1) // WORD_BITS))


def encode(ready: set[int], failed: dict[int, str], words: int) -> int:
    """This rank's bitmap as a Python int (bit 0 = least significant); 0 asks for the
    slow path."""
    capacity = words * WORD_BITS - 1
    if failed or not all(0 <= i < capacity for i in ready):
        return 0
    bits = FAST
    for i in ready:
        bits |= 2 << i
    return bits


def positions(bits: int) -> set[int]:
    """Queue positions whose ready bit is set."""
    out, bits = set(), bits >> 1
    while bits:
        low = bits & -bits
        out.add(low.bit_length() - 1)
        bits ^= low
    return out


def and_reduce(bits: int, words: int, group, word: Optional[torch.Tensor] = None) -> int:
    """Bitwise AND of ``bits`` over ``group``: one all_reduce of ``words`` int64s.
    Byte order does not matter to AND, so little-endian bytes are safe on any host.

    ``word``: a caller's reusable one-element int64 tensor for the one-word case: filled in
    place and read back with ``item()``, the call costs ~1.1x a bare one-word all_reduce,
    against ~1.25x through a fresh tensor over bytes (2 ranks, gloo, same run)."""
    if word is not None and words == 1:
        word.fill_(bits - (1 << 64) if bits >> 63 else bits)  # as a signed int64
        dist.all_reduce(word, op=dist.ReduceOp.BAND, group=group)
        return int(word.item()) & ((1 << 64) - 1)
    t = torch.frombuffer(bytearray(bits.to_bytes(words * 8, "little")), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BAND, group=group)
    return int.from_bytes(t.numpy().tobytes(), "little")


def agree_on_grammar_status(ready: set[int], failed: dict[int, str], tp: TPGroup,
                            queue_len: Optional[int] = None, word: Optional[torch.Tensor] = None
                            ) -> tuple[set[int], dict[int, str]]:
    """ready = intersection over ranks, failed = union (the lowest rank's message wins).
    A request both ready somewhere and failed elsewhere is failed. No-op at size 1.

    ``queue_len``: the grammar queue's length (the same on every rank); it sizes the
    bitmap. Without it the bitmap covers 63 positions and a larger ready index falls
    back to the slow exchange, with the same result. ``word``: see ``and_reduce``."""
    if tp.is_single:
        return ready - failed.keys(), failed
    words = bitmap_words(queue_len)
    agreed = and_reduce(encode(ready, failed, words), words, tp.cpu_group, word)
    if agreed & FAST:
        return positions(agreed), {}
    # Rare, and decided by the agreed bits, so every rank takes this branch together.
    logger.debug("[TP%d] grammar agreement: a failure (or an index past the bitmap): "
                 "exchanging ready lists and messages", tp.rank)
    gathered: list = [None] * tp.size
    dist.all_gather_object(gathered, (sorted(ready), failed), group=tp.cpu_group)
    agreed_failed: dict[int, str] = {}
    for _, rank_failed in gathered:  # rank order: deterministic messages
        for idx, message in rank_failed.items():
            agreed_failed.setdefault(idx, message)
    agreed_ready = set.intersection(*(set(r) for r, _ in gathered))
    return agreed_ready - agreed_failed.keys(), agreed_failed
