"""Verification rows for speculative decoding: the running batch's sampling state, one
row per verified position.

A request with d drafted tokens samples at d + 1 positions in one step; row j of it
(j = 0..d) is sampled as the plain step at that position would be, given the first j
drafts were accepted: penalties counting those drafts, the grammar mask after them, the
same logit bias and processors, and seeded noise keyed by that output position. The
step keeps a request's samples while they equal its drafts, then the first that differs
(or the one after the last draft). Sampling the target distribution and accepting while
the sample equals a deterministic draft is exactly rejection sampling with a point-mass
draft (accept with p(draft), a rejection drawn from the residual), so outputs have the
non-speculative distribution -- and seeded rows give the very same tokens.
"""
from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Optional, Sequence

import torch

from sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
from sampling.sampling_batch_info import SamplingBatchInfo


def verify_rows(drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(request of each verify row, offset j of the row within its request)."""
    src = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    offsets = [j for d in drafts for j in range(len(d) + 1)]
    return src, offsets


def expand_for_verify(info: SamplingBatchInfo, drafts: Sequence[Sequence[int]],
                      masks: Sequence[Optional[torch.Tensor]]) -> SamplingBatchInfo:
    """A SamplingBatchInfo with ``len(d) + 1`` rows per request (``info``'s row, then one
    per drafted token). ``info``'s own mask must be collected (update_regex_vocab_mask)
    first; ``masks[i]``: request i's mask rows for positions 1..d (None: no grammar).
    ``info`` itself is not changed."""
    src, offsets = verify_rows(drafts)
    idx = torch.tensor(src, dtype=torch.int64, device=info.device)
    out = SamplingBatchInfo(
        temperatures=info.temperatures[idx], top_ps=info.top_ps[idx], top_ks=info.top_ks[idx],
        min_ps=info.min_ps[idx], greedy_mask=info.greedy_mask[idx],
        seeds=[info.seeds[i] for i in src],
        positions=[info.positions[i] + j for i, j in zip(src, offsets)],
        logit_bias=[info.logit_bias[i] for i in src],
        custom_processors=[info.custom_processors[i] for i in src],
        custom_params=[info.custom_params[i] for i in src],
        penalizer_orchestrator=_expanded_penalties(info.penalizer_orchestrator, idx, drafts),
        vocab_size=info.vocab_size, device=info.device, generator=info.generator,
        grammars=[info.grammars[i] for i in src])
    out._refresh()
    buf = _expanded_mask(info, drafts, masks, len(src))
    if buf is not None:  # handed over as a finished fill: update_regex_vocab_mask takes it
        done: Future = Future()
        done.set_result((buf, [], 0.0))  # dead ends were reported on info's own rows
        out._mask_future = done
    return out


def _expanded_penalties(orch: BatchedPenalizerOrchestrator, idx: torch.Tensor,
                        drafts: Sequence[Sequence[int]]) -> BatchedPenalizerOrchestrator:
    """A copy with rows repeated; row j of a request also counts its first j drafts."""
    out = BatchedPenalizerOrchestrator(
        orch.batch_size, orch.vocab_size, orch.device,
        {kind: copy.copy(p) for kind, p in orch.penalizers.items()})
    if not out.is_required:
        out.batch_size = len(idx)
        return out
    out.filter(idx)  # new state objects: the copies never write into orch's tensors
    rows, ids = [], []
    start = 0
    for d in drafts:
        for j in range(1, len(d) + 1):  # row start + j counts d[:j]
            rows += [start + j] * j
            ids += list(d[:j])
        start += len(d) + 1
    if rows:
        out.cumulate_output_tokens(torch.tensor(ids, dtype=torch.int64, device=orch.device),
                                   torch.tensor(rows, dtype=torch.int64, device=orch.device))
    return out


def _expanded_mask(info: SamplingBatchInfo, drafts: Sequence[Sequence[int]],
                   masks: Sequence[Optional[torch.Tensor]], n_rows: int) -> Optional[torch.Tensor]:
    """Host bitmask for the verify rows, or None when no row is constrained."""
    if info.vocab_mask is None and all(m is None for m in masks):
        return None
    host = info._mask_buffer if info.vocab_mask is not None else None
    width = host.shape[1] if host is not None else next(m for m in masks if m is not None).shape[1]
    buf = torch.full((n_rows, width), -1, dtype=torch.int32)
    row = 0
    for i, d in enumerate(drafts):
        if host is not None:
            buf[row] = host[i]
        if d and masks[i] is not None:
            buf[row + 1:row + 1 + len(d)] = masks[i][:len(d)]
        row += len(d) + 1
    return buf
