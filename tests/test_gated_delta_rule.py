"""Gated DeltaNet torch math (srt/layers/linear_attention) against transformers' Qwen3.5 torch paths,
and against itself: one prefill == token-by-token decode == chunked prefill split anywhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.layers.linear_attention import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

ATOL = 1e-5
# Grouped value heads (Hv = 2 * Hk) and Dk != Dv, so a transposed state or head mapping shows up.
B, HK, HV, DK, DV = 2, 2, 4, 16, 24


def _inputs(t, seed=0, l2=True):
    """Inputs shaped as the model makes them: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, t, HK, DK), r(B, t, HK, DK), r(B, t, HV, DV)
    if not l2:  # without in-kernel L2 norm the keys must be small for the delta rule to stay stable
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    a_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log()
    g = -a_log.exp() * F.softplus(r(B, t, HV) + 1.0)
    beta = r(B, t, HV).sigmoid()
    return q, k, v, g, beta


def _state(seed=1):
    return torch.randn(B, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.1


def _close(*pairs):
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("l2", [True, False])
def test_matches_transformers(with_state, l2):
    q, k, v, g, beta = _inputs(77, l2=l2)  # 77: a full chunk of 64 plus a padded tail
    s0 = _state() if with_state else None
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    ref_out, ref_s = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **kw)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, 64, use_qk_l2norm=l2)
    _close((out, ref_out), (s, ref_s))
    ref_out, ref_s = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    out, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=l2)
    _close((out, ref_out), (s, ref_s))


def _rows(x, lo, hi):
    return [t[:, lo:hi] for t in x]


@pytest.mark.parametrize("split", [1, 17, 32, 64, 100])
def test_prefill_decode_and_split_prefill_agree(split):
    x, t, s0 = _inputs(130, seed=2), 130, _state(3)
    full, s_full = chunk_gated_delta_rule(*x, s0, chunk_size=32, use_qk_l2norm=True)
    # Token by token, carrying the state: what decode does.
    s, outs = s0, []
    for i in range(t):
        o, s = recurrent_gated_delta_rule(*_rows(x, i, i + 1), s, use_qk_l2norm=True)
        outs.append(o)
    _close((torch.cat(outs, 1), full), (s, s_full))
    # Two prefill pieces (split a multiple of chunk_size or not), carrying the state.
    o1, s1 = chunk_gated_delta_rule(*_rows(x, 0, split), s0, chunk_size=32, use_qk_l2norm=True)
    o2, s2 = chunk_gated_delta_rule(*_rows(x, split, t), s1, chunk_size=32, use_qk_l2norm=True)
    _close((torch.cat([o1, o2], 1), full), (s2, s_full))
    # The chunk size is a schedule, not semantics.
    o3, s3 = chunk_gated_delta_rule(*x, s0, chunk_size=64, use_qk_l2norm=True)
    _close((o3, full), (s3, s_full))


def test_inputs_are_not_modified():
    x, s0 = _inputs(5, seed=4), _state(5)
    snap = s0.clone()
    recurrent_gated_delta_rule(*x, s0, use_qk_l2norm=True)
    chunk_gated_delta_rule(*x, s0, use_qk_l2norm=True)
    assert torch.equal(s0, snap)


C, K = 10, 4


def _conv_inputs(t, seed=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, t, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv(activation):
    x, w, bias = _conv_inputs(9)
    y, state = causal_conv1d(x, w, bias, None, activation)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, bias, activation=activation).transpose(1, 2)
    _close((y, ref))
    assert torch.equal(state, x[:, -(K - 1):].transpose(1, 2))  # the last K-1 inputs
    # Step by step from a zero state == prefill; each step == transformers' update path (whose
    # state holds K inputs and is written in place, so it gets its own copy).
    st, hf_state, steps = None, torch.zeros(B, C, K), []
    for i in range(x.shape[1]):
        yi, st = causal_conv1d(x[:, i:i + 1], w, bias, st, activation)
        ref_i = hf.causal_conv1d_update(x[:, i:i + 1].transpose(1, 2), hf_state, w, bias, activation)
        _close((yi, ref_i.transpose(1, 2)))
        steps.append(yi)
    _close((torch.cat(steps, 1), y), (st, state))
    # Two prefill pieces carrying the state, including a piece shorter than K-1.
    ya, sa = causal_conv1d(x[:, :2], w, bias, None, activation)
    yb, sb = causal_conv1d(x[:, 2:], w, bias, sa, activation)
    _close((torch.cat([ya, yb], 1), y), (sb, state))


def test_rejected_draft_tokens_must_not_reach_kept_state():
    """A recurrent state cannot be rolled back: it absorbs every token it sees. Speculative decoding
    must snapshot before the draft and replay only the accepted rows from the snapshot."""
    ctx, draft, accepted = _inputs(20, seed=7), _inputs(5, seed=8), 2
    _, snap = chunk_gated_delta_rule(*ctx, use_qk_l2norm=True)
    xc, w, bias = _conv_inputs(20, seed=9)
    _, conv_snap = causal_conv1d(xc, w, bias, None, "silu")
    # Verify step: all draft tokens go through the layer, so this state absorbed rejected ones.
    _, s_all = recurrent_gated_delta_rule(*draft, snap, use_qk_l2norm=True)
    # Kept state: replay only the accepted rows from the snapshot...
    _, s_kept = recurrent_gated_delta_rule(*_rows(draft, 0, accepted), snap, use_qk_l2norm=True)
    # ...which is exactly the state of a run that only ever saw those tokens (prefill form too).
    _, s_only = chunk_gated_delta_rule(*_rows(draft, 0, accepted), snap, use_qk_l2norm=True)
    _close((s_kept, s_only))
    assert (s_all - s_kept).abs().max() > 1e-2  # the rejected tokens left a real trace
    # The conv state too: after the verify pass it holds rejected inputs.
    xd = _conv_inputs(5, seed=10)[0]
    _, c_all = causal_conv1d(xd, w, bias, conv_snap, "silu")
    _, c_kept = causal_conv1d(xd[:, :accepted], w, bias, conv_snap, "silu")
    assert torch.equal(c_kept[:, :, -accepted:], xd[:, :accepted].transpose(1, 2))
    assert not torch.equal(c_all, c_kept)
