"""One step's view of the linear-attention state pool: which rows of the batch continue which
request's state, and running a Gated DeltaNet layer over them.

Built once per step (beside the attention metadata) from the ForwardBatch; each GDN layer then
reads its states from the pool, runs, and writes them back:
- every request with a single row this step (a plain decode row, a one-token chunk) in one
  batched recurrent step, states gathered from and scattered to their slots;
- a request with several rows, in order: decode rows of one request (grammar fast-forward,
  speculative drafts) token by token, as separate decode steps would; a prefill chunk in the
  chunked form. With drafts, the state after each row is kept for the rollback of rejected
  ones (linear_state_pool.py).
A request's first forward (no prefix) starts from zero state, never from its slot's content.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from srt.mem_cache.linear_state_pool import LinearStatePool
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class StateSegment:
    start: int       # first row of the batch's tokens
    length: int      # rows
    slot: int        # state-pool slot (the request's req_pool_idx)
    fresh: bool      # the request's first forward: start from zero state
    recurrent: bool  # decode rows (token by token) rather than a prefill chunk
    first_len: int = 0  # the sequence length after the first row
    keep_rows: bool = False  # speculative drafts: keep the state after each row (rollback)
    # Prefill with the radix cache: (offset, checkpoint slot) - keep the state after the first
    # ``offset`` rows in that slot (mem_cache/state_checkpoints.py); offset may be the length.
    marks: tuple[tuple[int, int], ...] = ()


@dataclass
class LinearStateBatch:
    pool: LinearStatePool
    multi: tuple[StateSegment, ...]            # requests with several rows, run one by one
    single_rows: Optional[torch.Tensor] = None  # [S] rows of one-row requests
    single_slots: Optional[torch.Tensor] = None
    single_fresh: Optional[torch.Tensor] = None  # [S] bool, or None when no row is fresh


def _segments(fb: ForwardBatch, offset: int) -> list[StateSegment]:
    decode = fb.mode is ForwardMode.DECODE
    slots = fb.req_pool_indices.tolist()
    marks = fb.state_marks or [()] * len(slots)
    out: list[StateSegment] = []
    start = offset
    for slot, n, prefix, mark in zip(slots, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, marks):
        if decode and out and out[-1].slot == slot:  # another row of the same request
            last = out[-1]
            out[-1] = StateSegment(last.start, last.length + n, slot, last.fresh, True, last.first_len,
                                   fb.keep_row_states)
        else:
            out.append(StateSegment(start, n, slot, prefix == 0, decode, prefix + 1, marks=mark))
        start += n
    return out


def build_state_batch(fb: ForwardBatch, pool: LinearStatePool, new_step: bool = True) -> LinearStateBatch:
    """``new_step``: the step's first batch (a pipeline stage's later micro-batches pass False,
    so the step's kept row states stay)."""
    if fb.mode is ForwardMode.MIXED:
        segs = _segments(fb.decode_part, 0)
        segs += _segments(fb.extend_part, fb.decode_part.input_ids.shape[0])
    else:
        segs = _segments(fb, 0)
    if new_step:
        pool.begin_step()
    for seg in segs:
        if seg.keep_rows:
            pool.keep_rows(seg.slot, seg.first_len, seg.length)
    single = [s for s in segs if s.length == 1 and not s.marks]
    batch = LinearStateBatch(pool, tuple(s for s in segs if s.length > 1 or s.marks))
    if single:
        dev = pool.conv.device
        batch.single_rows = torch.tensor([s.start for s in single], dtype=torch.int64, device=dev)
        batch.single_slots = torch.tensor([s.slot for s in single], dtype=torch.int64, device=dev)
        if any(s.fresh for s in single):
            batch.single_fresh = torch.tensor([s.fresh for s in single], device=dev)
    return batch


def run_linear_attention(gdn, x: torch.Tensor, batch: LinearStateBatch, layer: int) -> torch.Tensor:
    """``gdn`` (a GatedDeltaNet) over the step's rows ``x [T, H]``, its states in pool layer ``layer``."""
    pool = batch.pool
    conv_l, rec_l = pool.conv[layer], pool.recurrent[layer]
    out = torch.empty_like(x)
    if batch.single_rows is not None:
        rows, slots = batch.single_rows, batch.single_slots
        conv, rec = conv_l.index_select(0, slots), rec_l.index_select(0, slots)
        if batch.single_fresh is not None:
            conv = conv.masked_fill(batch.single_fresh[:, None, None], 0)
            rec = rec.masked_fill(batch.single_fresh[:, None, None, None], 0)
        y, c, s = gdn.forward_batch(x.index_select(0, rows).unsqueeze(1), conv, rec, recurrent=True)
        out.index_copy_(0, rows, y.squeeze(1))
        conv_l.index_copy_(0, slots, c.to(conv_l.dtype))
        rec_l.index_copy_(0, slots, s)
    for seg in batch.multi:
        end = seg.start + seg.length
        conv = None if seg.fresh else conv_l[seg.slot]
        rec = None if seg.fresh else rec_l[seg.slot]
        if seg.keep_rows:
            y, c, s, conv_rows, rec_rows = gdn(x[seg.start:end], conv, rec, recurrent=True, all_states=True)
            kept = pool.row_states[seg.slot]
            kept.conv[layer], kept.recurrent[layer] = conv_rows, rec_rows
        elif seg.marks:
            y, c, s = _run_with_checkpoints(gdn, x[seg.start:end], conv, rec, seg.marks, conv_l, rec_l)
        else:
            y, c, s = gdn(x[seg.start:end], conv, rec, recurrent=seg.recurrent)
        out[seg.start:end] = y
        conv_l[seg.slot] = c
        rec_l[seg.slot] = s
    return out


def _run_with_checkpoints(gdn, x, conv, rec, marks, conv_l, rec_l):
    """A prefill chunk in pieces cut at the marks (an offset may be the chunk's end: a pipeline
    micro-batch cut there), the state after each cut stored in its slot."""
    ys, start = [], 0
    for cut, slot in (*marks, (x.shape[0], None)):
        if cut > start:
            y, conv, rec = gdn(x[start:cut], conv, rec)
            ys.append(y)
        if slot is not None:
            conv_l[slot], rec_l[slot] = conv, rec
        start = cut
    return torch.cat(ys), conv, rec
