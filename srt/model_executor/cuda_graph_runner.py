"""CUDA graphs for the decode step (SGLang's ``--disable-cuda-graph`` / ``--cuda-graph-max-bs``).

A decode step launches a few hundred small kernels; on a GPU their launch cost, not the
math, bounds a small batch. We capture the decode forward once per batch-size bucket into
a CUDA graph over static input buffers and replay it: a served batch is padded up to the
next bucket (padding rows decode token 0 into the dummy KV slot 0 with sequence length 1,
reading row 0 of ``req_to_token``, so they touch no request's KV) and the logits are cut
back to the real rows.

Only the ``triton`` attention backend is captured: its decode kernel takes the batch from
device tensors and syncs nothing with the host, while ``torch_native`` builds host-side
metadata every step. Capture runs before the server reports ready, identically on every
rank. After capturing, the smallest and largest graphs are replayed on a batch at serving
lengths (random K/V over up to 1,024 keys per sequence, ``real_length_inputs``) and
compared with the eager forward; any failure or mismatch disables CUDA graphs on every
rank with a warning.
Unverified on GPU hardware until a GPU run says otherwise (docs/speed.md).
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# Decode tensors of a ForwardBatch that the graphs read from static buffers.
_INPUT_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
_PAD_VALUES = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "req_pool_indices": 0, "seq_lens": 1}


def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's buckets: 1, 2, 4, 8, then every 8 up to ``max_bs`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    return sorted(set(sizes) | {max_bs})


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, max_bs: int, make_batch: Callable[[dict], ForwardBatch],
                 device: str, log_prefix: str):
        """``make_batch(tensors)`` builds a DECODE ForwardBatch over the given input tensors
        (the runner's pools and attention backend attached)."""
        self.model, self.make_batch, self.log_prefix = model, make_batch, log_prefix
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.buffers = {name: torch.full((self.max_bs,), _PAD_VALUES[name], dtype=torch.int64, device=device)
                        for name in _INPUT_FIELDS}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode is ForwardMode.DECODE and fb.batch_size <= self.max_bs and bool(self.graphs)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return self.make_batch({name: buf[:bs] for name, buf in self.buffers.items()})

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller graphs reuse the largest one's memory pool."""
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton autotunes/compiles outside the capture
                    self.model(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[bs] = self.model(fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def self_check(self, atol: float, check_inputs: Callable[[int], dict] | None = None) -> bool:
        """Replay the smallest and largest graph and compare with the eager forward: on
        ``check_inputs(bs)`` (a batch at serving lengths, see ``real_length_inputs``) where
        given, else on the padding-only dummy batch."""
        for bs in sorted({self.batch_sizes[0], self.max_bs}):
            fb = self.make_batch(check_inputs(bs)) if check_inputs is not None else self._static_batch(bs)
            want = self.model(fb).float()
            got = (self(fb) if check_inputs is not None else self._replay(bs)).float()
            if not torch.allclose(got, want, atol=atol, rtol=0):
                logger.warning("%s CUDA graph at batch %d differs from eager by %.3g", self.log_prefix,
                               bs, (got - want).abs().max().item())
                return False
        return True

    def _replay(self, bs: int) -> torch.Tensor:
        self.graphs[bs].replay()
        return self.outputs[bs]

    def disable(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        raw_bs = fb.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, raw_bs)]
        for name, buf in self.buffers.items():
            buf[:raw_bs].copy_(getattr(fb, name), non_blocking=True)
            if bs > raw_bs:
                buf[raw_bs:bs].fill_(_PAD_VALUES[name])
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs]


def real_length_inputs(bs: int, req_to_token: torch.Tensor, kv_pool, max_len: int = 1024,
                       seed: int = 0) -> dict[str, torch.Tensor]:
    """A decode batch at serving lengths for the start-up self-check, before any request
    holds a KV slot: rows 0..bs-1 of ``req_to_token`` point at distinct random pool slots
    (never the dummy slot 0), lengths spread from 1 to ``max_len`` (capped by the pool and
    the context), and those slots hold random K/V in every layer, so attention's split-K
    paths run over real key counts. The caller zeroes ``req_to_token`` afterwards: a row
    is taken only by a request, and none exists yet."""
    device = req_to_token.device
    gen = torch.Generator().manual_seed(seed)
    longest = max(1, min(max_len, kv_pool.size // bs, req_to_token.shape[1] - 1))
    lens = torch.linspace(1, longest, bs).round().to(torch.int64).clamp(min=1)
    slots = torch.randperm(kv_pool.size, generator=gen)[: int(lens.sum())] + 1
    start = 0
    for row, n in enumerate(lens.tolist()):
        req_to_token[row, :n] = slots[start:start + n].to(device)
        start += n
    slots = slots.to(device)
    for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer):
        for buf in (k, v):
            noise = torch.randn(buf.shape[0], slots.numel(), buf.shape[2], generator=gen)
            buf.index_copy_(1, slots, noise.to(device=device, dtype=buf.dtype))
    seq_lens = lens.to(device)
    rows = torch.arange(bs, dtype=torch.int64, device=device)
    return {"input_ids": torch.randint(0, 1000, (bs,), generator=gen).to(device), "positions": seq_lens - 1,
            "out_cache_loc": req_to_token[rows, seq_lens - 1].clone(), "req_pool_indices": rows,
            "seq_lens": seq_lens}
