"""The Sampler: greedy fast path (``greedy.py``); otherwise temperature, then top-k / top-p / min-p and an
exact sample, with no full-vocabulary sort (``sort_free``). On CUDA with the ``flashinfer``
package installed, batches without per-request seeds use FlashInfer's fused rejection
sampling kernels; seeded rows always use the hashed (seed, position) uniforms so they are
reproducible everywhere.

Non-finite logits (NaN, +inf, or a row with no finite value at all) never crash the
server: NaN becomes -inf, +inf a large finite value, an all -inf row uniform (over the
tokens its grammar mask allows, when it has one); the first occurrence is logged.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from constrained.bitmask_ops import unpack_bitmask
from sampling import flashinfer_backend
from sampling.greedy import greedy_ids, native_greedy
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.seeded_random import row_uniforms
from sampling.sort_free import sample_filtered, sample_unfiltered, workspace_for, workspace_rows

logger = logging.getLogger(__name__)
_LARGE_LOGIT = 1e30  # stands in for +inf; finite after dividing by any allowed temperature


class Sampler:
    def __init__(self, log_prefix: str = ""):
        self.log_prefix = log_prefix
        self.warned_non_finite = False
        self._workspace: dict[tuple, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """int64 [B] token ids. ``logits`` (float32 [B, V]) may be modified in place;
        temperature is folded into the sort-free passes instead of a sweep over [B, V]."""
        if info.is_all_greedy:
            ids = native_greedy(logits)  # one C++ pass on CPU when every row is finite
            if ids is not None:
                return ids
        self.sanitize(logits, info.vocab_mask)
        if info.is_all_greedy:
            return greedy_ids(logits)
        greedy = greedy_ids(logits) if info.has_greedy else None
        if flashinfer_backend.usable(logits, info):
            ids = flashinfer_backend.sample(logits.div_(info.temperatures), info)
        else:
            ids = self._sample_sort_free(logits, info)
        if greedy is not None:
            ids = torch.where(info.greedy_mask, greedy, ids)
        return ids

    def _sample_sort_free(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        u = row_uniforms(info.seeds, info.positions, info.generator, logits.device)
        ws = self._workspace_for(logits)
        inv_t = 1.0 / info.temperatures
        filtered = info.filtered_rows_mask()
        if not filtered.any():
            return sample_unfiltered(logits, inv_t, u, ws)
        if filtered.all():
            return sample_filtered(logits, inv_t, info.top_ks, info.top_ps, info.min_ps, u, ws,
                                   info.need_top_p)
        ids = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
        f = filtered.nonzero().squeeze(1)
        n = (~filtered).nonzero().squeeze(1)
        ids[f] = sample_filtered(logits[f], inv_t[f], info.top_ks[f], info.top_ps[f],
                                 info.min_ps[f], u[f], ws, info.need_top_p)
        ids[n] = sample_unfiltered(logits[n], inv_t[n], u[n], ws)
        return ids

    def _workspace_for(self, logits: torch.Tensor) -> torch.Tensor:
        key = (logits.device, logits.shape[1])
        ws = self._workspace.get(key)
        if ws is None or ws.shape[0] < workspace_rows(len(logits), logits.shape[1], logits.device):
            ws = self._workspace[key] = workspace_for(len(logits), logits.shape[1], logits.device)
        return ws

    def sanitize(self, logits: torch.Tensor, vocab_mask: Optional[torch.Tensor] = None) -> None:
        """Make every row samplable; a NaN anywhere or +inf makes the row max non-finite.
        A row left with no finite logit is sampled uniformly -- over the tokens its grammar
        mask allows, if it has one, so a masked row never yields a forbidden token (a row
        whose mask allows nothing is aborted by the scheduler; its token is never used)."""
        row_max = logits.amax(dim=-1)
        bad = ~torch.isfinite(row_max)
        if not bad.any():
            return
        rows = bad.nonzero().squeeze(1)
        sub = torch.nan_to_num(logits[rows], nan=float("-inf"), posinf=_LARGE_LOGIT,
                               neginf=float("-inf"))
        empty = sub.amax(dim=-1) == float("-inf")
        if vocab_mask is not None and empty.any():
            allowed = unpack_bitmask(vocab_mask[rows[empty]].cpu(), logits.shape[1]).to(logits.device)
            uniform = torch.zeros_like(sub[empty]).masked_fill_(~allowed, float("-inf"))
            uniform[~allowed.any(dim=-1)] = 0.0
            sub[empty] = uniform
        else:
            sub[empty] = 0.0
        logits[rows] = sub
        if not self.warned_non_finite:
            self.warned_non_finite = True
            logger.warning("%s non-finite logits in %d row(s) (NaN/inf, or every token masked); "
                           "sanitized and still serving (logged once)", self.log_prefix, len(rows))
