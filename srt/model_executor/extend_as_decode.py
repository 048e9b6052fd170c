"""A prefill of few new tokens run as decode rows, through the compiled decode graphs.

A prefill whose prompt is mostly cached (a prompt sent again, each of ``n`` > 1 choices
after the first, a chat turn that adds a few tokens) computes only a handful of tokens, yet
through the compiled prefill it pays per layer: two graph calls with their guards, eager
attention between them, and the small kernels' thread wake-ups. On the shipped GGUF (bf16,
2-vCPU Xeon with AMX) a one-token extend took ~27 ms that way against ~8.5 ms for a
batch-1 decode step, which is the same computation.

Decode rows compute exactly a causal extend (kv_cache_manager.prepare_decode: rows of one
request share its table row at consecutive positions; every layer writes all rows' K/V
before attending, and each row attends to positions up to its own). So an EXTEND batch
that needs only each sequence's last logits, and whose new tokens fit the compiled decode
graphs, is handed to them as one row per new token; the logits of each sequence's last row
are returned. The scheduler's bookkeeping (slots, table, cache) is the prefill's, done
before: only the forward changes.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode


def extend_as_decode(fb: ForwardBatch, max_rows: int) -> Optional[tuple[ForwardBatch, Optional[torch.Tensor]]]:
    """(the decode batch, each sequence's last row or None where every sequence adds one
    token), or None where the batch must prefill: not EXTEND, rows of logits other than
    each sequence's last (prompt logprobs), a hybrid model's state marks, or more new
    tokens than ``max_rows``."""
    if (fb.mode is not ForwardMode.EXTEND or fb.logit_rows is not None or fb.return_all_logits
            or fb.state_marks is not None):
        return None
    lens = fb.extend_seq_lens_cpu
    total = sum(lens)
    if total > max_rows:
        return None
    if all(n == 1 for n in lens):  # already shaped as decode rows (prefix = seq_len - 1)
        return dataclasses.replace(fb, mode=ForwardMode.DECODE), None
    positions = [p for start, n in zip(fb.extend_prefix_lens_cpu, lens) for p in range(start, start + n)]
    # Outside inference mode, as the scheduler makes a decode batch's tensors: the decode
    # graphs compiled by torch.compile guard on how their inputs were made.
    with torch.inference_mode(False):
        counts = torch.tensor(lens, dtype=torch.int64, device=fb.input_ids.device)
        rows = fb.req_pool_indices.repeat_interleave(counts)
        seq_lens = fb.positions + 1
        last = torch.cumsum(counts, 0) - 1
    decode = dataclasses.replace(
        fb, mode=ForwardMode.DECODE, req_pool_indices=rows, seq_lens=seq_lens,
        seq_lens_cpu=[p + 1 for p in positions], extend_seq_lens_cpu=[1] * total,
        extend_prefix_lens_cpu=positions)
    return decode, last
