"""Exact sampling from temperature-scaled logits without sorting the vocabulary.

Temperature is folded into the passes (``inv_temps`` [b, 1]) rather than applied to the
whole logits tensor first: one less sweep over [B, V] memory. Both paths pick, per row, the first token whose cumulative probability exceeds ``u * Z``
(inverse-CDF sampling with one uniform ``u`` per row, see ``seeded_random``).

- Unfiltered rows: a two-level inverse CDF. ``exp(x - max)`` is written into a small
  reused workspace (8 MB of rows at a time, so it stays in cache and costs no page faults),
  summed per block of 1024 tokens; the block is found from the block sums and the token
  inside it. O(V) work, no sort, no [B, V] temporaries.
- Rows with top-k / top-p / min-p: a bounded top-k pre-selection (FlashInfer's kernels
  avoid a sort with rejection sampling; on CPU a partial selection is the fast equivalent).
  ``topk(k)`` candidates, with probabilities normalised over the *whole* vocabulary, decide
  the kept prefix exactly whenever the prefix ends inside them: top_k <= k, the candidates'
  mass exceeds top_p, or the last candidate falls under the min-p floor. Rows not decided
  retry with 8x more candidates (up to the vocabulary), so the result is always exact.

Kept set (SGLang's joint rule): rank < top_k, mass of higher-ranked tokens <= top_p, and
p >= min_p * p_max.
"""
from __future__ import annotations

import torch

BLOCK = 1024  # tokens per block of the two-level inverse CDF
CHUNK_ELEMENTS = 1 << 21  # floats per workspace pass (8 MB): stays in cache, and few passes
CUDA_CHUNK_ELEMENTS = 1 << 26  # 256 MB on a GPU: 256 rows of a 248k vocabulary in one pass
INITIAL_CANDIDATES = 256
# On a GPU each retry pass costs dozens of launches and host syncs while a wider topk costs
# little, so rows without a small top-k (top-p / min-p alone) start this wide there.
CUDA_INITIAL_CANDIDATES = 4096


def inverse_cdf(weights: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum of ``weights`` exceeds ``targets``;
    rounding can never select a zero-weight entry (falls back to the last positive one)."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    idx.clamp_(max=weights.shape[1] - 1)
    positive = weights > 0
    last_positive = (positive * torch.arange(1, weights.shape[1] + 1, device=weights.device)).argmax(dim=1)
    ok = positive.gather(1, idx.unsqueeze(1)).squeeze(1)
    return torch.where(ok, idx, last_positive)


def workspace_rows(batch_rows: int, vocab_size: int, device="cpu") -> int:
    """Rows per pass: as many as fit the device's chunk (fewer, larger ops keep the cores
    busy). A GPU has no cache to stay in but pays a launch per op: it takes the whole batch."""
    chunk = CUDA_CHUNK_ELEMENTS if torch.device(device).type == "cuda" else CHUNK_ELEMENTS
    return max(1, min(batch_rows, chunk // vocab_size))


def workspace_for(batch_rows: int, vocab_size: int, device) -> torch.Tensor:
    """Zeroed once: the padding columns past the vocabulary are never written, so stay 0."""
    nb = -(-vocab_size // BLOCK)
    return torch.zeros((workspace_rows(batch_rows, vocab_size, device), nb * BLOCK),
                       dtype=torch.float32, device=device)


def _scaled_exp(logits: torch.Tensor, row_max: torch.Tensor, inv_temps: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """out = exp((logits - row_max) * inv_temps). Shift first: x - max is in [-inf, 0] and
    cannot overflow, whereas a fused x * t - max * t can for huge finite logits."""
    return torch.sub(logits, row_max, out=out).mul_(inv_temps).exp_()


def sample_unfiltered(logits: torch.Tensor, inv_temps: torch.Tensor, u: torch.Tensor,
                      workspace: torch.Tensor) -> torch.Tensor:
    """Exact sample per row of softmax(logits * inv_temps); ``workspace`` from ``workspace_for``."""
    b, v = logits.shape
    nb = workspace.shape[1] // BLOCK
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    row_max = logits.amax(dim=1, keepdim=True)
    for start in range(0, b, workspace.shape[0]):
        end = min(start + workspace.shape[0], b)
        c = end - start
        buf = workspace[:c]
        _scaled_exp(logits[start:end], row_max[start:end], inv_temps[start:end], buf[:, :v])
        blocks = buf.view(c, nb, BLOCK)
        block_sums = blocks.sum(dim=-1).double()  # fp32 sums of 1024 terms: exact enough
        targets = u[start:end] * block_sums.sum(dim=1)
        blk = inverse_cdf(block_sums, targets)
        before = torch.cumsum(block_sums, dim=1).gather(1, blk.unsqueeze(1)).squeeze(1) \
            - block_sums.gather(1, blk.unsqueeze(1)).squeeze(1)
        inner = blocks.gather(1, blk.view(c, 1, 1).expand(c, 1, BLOCK)).squeeze(1)  # [c, BLOCK]
        tok = inverse_cdf(inner, targets - before)
        out[start:end] = blk * BLOCK + tok
    return out


def _normalizers(logits: torch.Tensor, row_max: torch.Tensor, inv_temps: torch.Tensor,
                 workspace: torch.Tensor) -> torch.Tensor:
    """float64 [b]: sum(exp((x - row_max) * inv_temp)) per row, through the reused workspace."""
    b, v = logits.shape
    z = torch.empty(b, dtype=torch.float64, device=logits.device)
    for start in range(0, b, workspace.shape[0]):
        end = min(start + workspace.shape[0], b)
        buf = workspace[: end - start, :v]
        _scaled_exp(logits[start:end], row_max[start:end].unsqueeze(1), inv_temps[start:end], buf)
        z[start:end] = buf.sum(dim=1)  # a float64 accumulate would copy the buffer
    return z


def sample_filtered(logits: torch.Tensor, inv_temps: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                    min_ps: torch.Tensor, u: torch.Tensor, workspace: torch.Tensor,
                    need_top_p: bool) -> torch.Tensor:
    """Exact top-k / top-p / min-p sample per row (top_ks int64, top_ps/min_ps float32, inv_temps [b, 1])."""
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    small_ks = top_ks[top_ks <= 4 * INITIAL_CANDIDATES]
    initial = CUDA_INITIAL_CANDIDATES if logits.is_cuda and len(small_ks) < b else INITIAL_CANDIDATES
    k = min(v, max(initial, int(small_ks.max()) if len(small_ks) else 0))
    todo = torch.arange(b, device=logits.device)
    z = None
    while len(todo):
        rows = logits if len(todo) == b else logits[todo]  # avoid copying the whole batch
        vals, idx = torch.topk(rows, k, dim=1)
        if z is None:  # first pass covers every row: probabilities over the whole vocabulary
            z = _normalizers(logits, vals[:, 0], inv_temps, workspace) if need_top_p \
                else torch.ones(b, dtype=torch.float64, device=logits.device)
        rel = torch.exp((vals - vals[:, :1]).double() * inv_temps[todo].double())  # p / p_max
        p = rel / z[todo].unsqueeze(1)
        mass = torch.cumsum(p, dim=1)
        tk, tp, mp = top_ks[todo].unsqueeze(1), top_ps[todo].double().unsqueeze(1), min_ps[todo].double().unsqueeze(1)
        rank = torch.arange(k, device=logits.device).unsqueeze(0)
        keep = (rank < tk) & (rel >= mp)
        if need_top_p:
            keep &= (mass - p) <= tp
        decided = (tk.squeeze(1) <= k) | (rel[:, -1] < mp.squeeze(1)) | (k == v)
        if need_top_p:
            decided |= mass[:, -1] > tp.squeeze(1)
        if decided.any():
            w = torch.where(keep[decided], rel[decided], 0.0)
            pick = inverse_cdf(w, u[todo[decided]] * w.sum(dim=1))
            out[todo[decided]] = idx[decided].gather(1, pick.unsqueeze(1)).squeeze(1)
        todo = todo[~decided]
        k = min(v, k * 8)
    return out
