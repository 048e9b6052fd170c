"""Logprobs of chosen tokens and their top alternatives.

Two modes (``--logprobs-mode``, vLLM's flag and values):
- ``processed_logprobs`` (default): the distribution the token was drawn from, i.e. the
  logits after penalties, the grammar mask, logit bias (and custom processors), divided by
  the temperature (greedy rows: temperature 1). A token the grammar masks has logprob
  -inf and never appears among the top alternatives.
- ``raw_logprobs``: the model's own distribution, before any of that.
Top-k filtering, top-p and min-p are not applied: they shape which token is drawn, not the
distribution it is described by (as in vLLM).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from sampling.sampling_params import MAX_TOP_LOGPROBS  # noqa: F401  (re-exported)

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")

_MASKED = -1e38  # at or below: a masked token
TopLogprobs = tuple[tuple[int, float], ...]


def log_softmax_rows(logits: torch.Tensor, temperatures: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 logprobs of ``logits`` rows, after dividing by ``temperatures`` ([R, 1]).
    NaN counts as -inf and +inf as a large value, as the sampler treats them; so does a
    logit at the float32 floor (how some masks write "not allowed")."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=1e30)
    # A masked logit may be the dtype's lowest finite value rather than -inf (bitmask_ops).
    x.masked_fill_(x <= _MASKED, float("-inf"))
    if temperatures is not None:
        x = x / temperatures
    return torch.log_softmax(x, dim=-1)


def model_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 logprobs of raw model logits (prompt logprobs): no masks, no temperature,
    so one fused pass (``log_softmax_rows`` guards sampled rows against masks and NaN)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


# Rows per log-softmax for prompt logprobs: a block's float32 logprobs (3 MB at a 49k
# vocabulary) stay in cache for the gather and max that read them next; measured ~25%
# faster than one call over a whole prompt's rows (bf16, 2 cores).
PROMPT_LOGPROB_BLOCK_ROWS = 16


def model_chosen_and_top(logits: torch.Tensor, ids: torch.Tensor,
                         top_ns: Sequence[int]) -> list[tuple[float, TopLogprobs]]:
    """``chosen_and_top`` over the model's own distribution of ``logits`` rows (prompt
    logprobs), a block of rows at a time."""
    out: list[tuple[float, TopLogprobs]] = []
    step = PROMPT_LOGPROB_BLOCK_ROWS
    for i in range(0, len(ids), step):
        out += chosen_and_top(model_log_softmax(logits[i:i + step]), ids[i:i + step], top_ns[i:i + step])
    return out


def chosen_and_top(logprobs: torch.Tensor, ids: torch.Tensor,
                   top_ns: Sequence[int]) -> list[tuple[float, TopLogprobs]]:
    """For each row: the logprob of ``ids[row]`` and the ``top_ns[row]`` most likely tokens
    as (id, logprob), most likely first; tokens with logprob -inf (masked) are left out."""
    if len(ids) == 0:
        return []
    chosen = logprobs.gather(1, ids.view(-1, 1).to(logprobs.device)).squeeze(1).tolist()
    k = min(max(top_ns, default=0), logprobs.shape[1])
    if k == 0:
        return [(c, ()) for c in chosen]
    if k == 1:  # one alternative (lm-eval's logprobs: 1): a max pass, not a top-k
        vals, idx = logprobs.max(dim=-1, keepdim=True)
    else:
        vals, idx = torch.topk(logprobs, k, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    out = []
    for row, c in enumerate(chosen):
        n = top_ns[row]
        top = tuple((t, v) for t, v in zip(idx[row][:n], vals[row][:n]) if v != float("-inf"))
        out.append((c, top))
    return out
