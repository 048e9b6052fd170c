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
rank. After capturing, each graph is replayed once on a dummy batch and compared with the
eager forward; any failure or mismatch disables CUDA graphs on every rank with a warning.
Unverified on GPU hardware until a GPU run says otherwise (docs/speed.md).
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from srt.forward_batch import ForwardBatch, ForwardMode

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
    def self_check(self, atol: float) -> bool:
        """Replay the smallest and largest graph on the (padding-only) dummy batch and compare
        with the eager forward."""
        for bs in sorted({self.batch_sizes[0], self.max_bs}):
            want = self.model(self._static_batch(bs)).float()
            self.graphs[bs].replay()
            got = self.outputs[bs].float()
            if not torch.allclose(got, want, atol=atol, rtol=0):
                logger.warning("%s CUDA graph at batch %d differs from eager by %.3g", self.log_prefix,
                               bs, (got - want).abs().max().item())
                return False
        return True

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
