"""Gated delta rule (Gated DeltaNet, as in Qwen3-Next / Qwen3.5 linear-attention layers), plain torch.

Per value head, with a state S of shape [Dk, Dv] and one token (q, k, v, g, beta):

    S <- exp(g) * S                      # gated decay (g <= 0, log space)
    S <- S + beta * k (v - S^T k)^T       # delta rule: write only what S does not already predict
    o  = S^T (q * scale)                  # read after the write

Shapes (one convention for both functions, the same as transformers' torch paths):
    q, k:  [B, T, Hk, Dk]   v: [B, T, Hv, Dv]   g, beta: [B, T, Hv]   state: [B, Hv, Dk, Dv]
    out:   [B, T, Hv, Dv] in q's dtype; the state is always fp32.
Hv must be a multiple of Hk: each q/k head serves Hv // Hk consecutive value heads (grouped value
attention). The math runs in fp32 whatever the input dtype, because the state is a running sum
over the whole sequence and bf16 rounding would accumulate into it.

Neither function writes into its arguments: a caller that snapshots a state (speculative decoding,
prefix caching) can rely on the snapshot staying as it was.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): the eps inside the root, as FLA and transformers do."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm, scale):
    """Head-major fp32 tensors: q/k/v [B, Hv, T, D], g/beta [B, Hv, T]; q already scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g, beta


def _initial_state(state, b, h, dk, dv, device):
    if state is None:
        return torch.zeros(b, h, dk, dv, dtype=torch.float32, device=device)
    if state.shape != (b, h, dk, dv):
        raise ValueError(f"state shape {tuple(state.shape)} != {(b, h, dk, dv)}")
    return state.float()


def _unit_lower_solve(a, rhs):
    return torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None, *, use_qk_l2norm=False, scale=None,
                               all_states=False):
    """Token-by-token gated delta rule (decode, T typically 1; any T works).

    Same shapes as the module docstring; ``state`` None means a zero state. Returns
    ``(out [B, T, Hv, Dv], new_state [B, Hv, Dk, Dv] fp32)``; ``state`` itself is not modified.
    ``all_states``: also the state after each token, ``[B, T, Hv, Dk, Dv]`` (speculative
    decoding keeps the one after the last accepted row).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, t, dk = k.shape
    s = _initial_state(state, b, h, dk, v.shape[-1], v.device)
    outs, states = [], []
    # The per-head matvecs as broadcast multiply + sum: as batched matmuls (einsum) they ran as
    # B x H tiny GEMMs, ~5x slower on CPU. The first product makes a new tensor, so the updates
    # after it may run in place without touching the caller's state.
    decay = g.exp()
    for i in range(t):
        s = s * decay[:, :, i, None, None]
        k_i = k[:, :, i].unsqueeze(-1)                                     # [B, H, Dk, 1]
        pred = (s * k_i).sum(-2)                                           # what S already maps k to
        delta = (v[:, :, i] - pred) * beta[:, :, i, None]
        s.add_(k_i * delta.unsqueeze(-2))
        outs.append((s * q[:, :, i].unsqueeze(-1)).sum(-2))
        if all_states:
            states.append(s.clone() if i + 1 < t else s)
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(b, h, 0, v.shape[-1])
    if all_states:
        return out.transpose(1, 2).to(out_dtype), s, torch.stack(states, dim=1)
    return out.transpose(1, 2).to(out_dtype), s


def chunk_gated_delta_rule(
    q, k, v, g, beta, initial_state=None, chunk_size=64, *, use_qk_l2norm=False, scale=None
):
    """Chunked gated delta rule (prefill): exactly the recurrence above, in chunk_size blocks.

    Within a chunk the T sequential delta updates are solved at once (the UT / WY form): with
    gamma = cumsum(g) inside the chunk, the per-token corrections U satisfy the unit lower
    triangular system (I + A) U = beta*V - beta*exp(gamma)*K S0, A[t, j] = beta_t
    exp(gamma_t - gamma_j) k_t.k_j for j < t. Only the small [C, C] solve and one state carry per
    chunk remain sequential. The tail is zero-padded to a whole chunk: padded rows have k = v = 0,
    beta = 0 and g = 0, so they neither write to nor decay the state.

    Shapes as in the module docstring. Returns ``(out [B, T, Hv, Dv], final_state fp32)``.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    s = _initial_state(initial_state, b, h, dk, dv, v.device)
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    gamma = g.cumsum(-1)                                                   # [B, H, N, C]
    # exp(gamma_t - gamma_j) for j <= t; the masked upper part would be exp(positive) and can
    # overflow, so it becomes -inf before the exp rather than being zeroed after it.
    above = torch.ones(c, c, dtype=torch.bool, device=v.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # I + A: unitriangular=True supplies the unit diagonal, and tril(-1) keeps A strictly lower.
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    # U = u0 - w @ S0: the S0-free part and the per-state correction, solved once per chunk.
    u0 = _unit_lower_solve(system, v * beta.unsqueeze(-1))
    w = _unit_lower_solve(system, k_beta * gamma.exp().unsqueeze(-1))
    attn = (q @ k.transpose(-1, -2)) * decay                      # causal, diagonal included
    q_dec = q * gamma.exp().unsqueeze(-1)                         # reads S0 decayed to t
    k_dec = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)     # writes decayed to chunk end
    chunk_decay = gamma[..., -1].exp()                            # [B, H, N]

    out = torch.empty(b, h, n, c, dv, dtype=torch.float32, device=v.device)
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ s                          # corrections given S0 = s
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ u
        s = s * chunk_decay[:, :, i, None, None] + k_dec[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * c, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype), s
