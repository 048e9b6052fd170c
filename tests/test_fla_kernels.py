"""FLA's gated-delta-rule kernels (CUDA, ``fla-core``) against our torch path, the reference
checked against transformers (test_gated_delta_rule.py): chunked prefill with and without an
initial state, and the decode step, with grouped value heads as Qwen3.5 has them; then a whole
GatedDeltaNet layer on CUDA with GRAMSYNC_FLA_KERNELS on and off. Runs in ``make gpu-check``;
skipped without CUDA or fla."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from srt.layers.linear_attention.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")]


def _inputs(t: int, b: int = 2, hk: int = 2, hv: int = 4, d: int = 64):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = r(b, t, hk, d), r(b, t, hk, d), r(b, t, hv, d)
    gate = -torch.rand(b, t, hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(b, t, hv, device="cuda", generator=g)
    return q, k, v, gate, beta, r(b, hv, d, d) * 0.1


def _close(a, b, tol=2e-3):
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_prefill_matches_the_torch_path(with_state):
    from srt.layers.linear_attention.fla_kernels import fla_gated_delta_rule

    q, k, v, g, beta, s0 = _inputs(200)
    s0 = s0 if with_state else None
    want, want_s = chunk_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)
    got, got_s = fla_gated_delta_rule(q, k, v, g, beta, s0, recurrent=False)
    _close(got, want)
    _close(got_s, want_s)


def test_decode_step_matches_the_torch_path():
    from srt.layers.linear_attention.fla_kernels import fla_gated_delta_rule

    q, k, v, g, beta, s0 = _inputs(1)
    want, want_s = recurrent_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)
    got, got_s = fla_gated_delta_rule(q, k, v, g, beta, s0, recurrent=True)
    _close(got, want)
    _close(got_s, want_s)


def test_layer_on_cuda_with_and_without_fla(monkeypatch):
    from srt.layers.linear_attention.gated_deltanet import GatedDeltaNet

    cfg = SimpleNamespace(hidden_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                          hidden_act="silu", rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = GatedDeltaNet(cfg, params_dtype=torch.float32)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(150, 128, device="cuda")
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv("GRAMSYNC_FLA_KERNELS", on)
        y, c, s = layer(x[:149])
        y2, _, s2 = layer(x[149:], c, s)
        outs.append((torch.cat([y, y2]), s2))
    _close(outs[0][0], outs[1][0])
    _close(outs[0][1], outs[1][1])
