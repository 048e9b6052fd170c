"""GatedDeltaNet layer (srt/layers/linear_attention) against transformers' Qwen3_5GatedDeltaNet, and
against itself: prefill == prefill + token-by-token decode == prefill in two pieces, carrying states."""
from __future__ import annotations

import pytest
import torch

from srt.layers.linear_attention.gated_deltanet import GatedDeltaNet
from srt.layers.linear_attention.gated_rms_norm import GatedRMSNorm

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
from transformers import Qwen3_5TextConfig

ATOL = 1e-5
T = 77  # a whole chunk of 64 plus a padded tail


def _config():
    # Hv = 2 * Hk and Dk != Dv, so a wrong head grouping or a transposed state shows up.
    return Qwen3_5TextConfig(
        hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["linear_attention"])


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    ref = hf.Qwen3_5GatedDeltaNet(_config(), layer_idx=0).eval()
    with torch.no_grad():  # the init leaves dt_bias and the norm weight at ones: make them count
        ref.dt_bias.normal_()
        ref.norm.weight.uniform_(0.5, 1.5)
    ours = GatedDeltaNet(_config(), params_dtype=torch.float32)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _x(t=T, seed=1):
    return torch.randn(t, 48, generator=torch.Generator().manual_seed(seed))


def _close(*pairs):
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


@torch.no_grad()
def test_prefill_matches_transformers(layers):
    ref, ours = layers
    x = _x()
    y, conv, s = ours(x)
    _close((y, ref(x.unsqueeze(0), cache=None, attention_mask=None).squeeze(0)))
    conv_shape, s_shape = ours.state_shapes()
    assert conv.shape == conv_shape and s.shape == s_shape and s.dtype == torch.float32


@pytest.mark.parametrize("n", [1, 5, 64])
@torch.no_grad()
def test_prefill_then_decode_matches_prefill(layers, n):
    _, ours = layers
    x = _x(40 + n, seed=2)
    full, conv_full, s_full = ours(x)
    ys, conv, s = [], None, None
    y, conv, s = ours(x[:n], conv, s)
    ys.append(y)
    for i in range(n, x.shape[0]):  # T == 1: the recurrent path
        y, conv, s = ours(x[i:i + 1], conv, s)
        ys.append(y)
    _close((torch.cat(ys), full), (conv, conv_full), (s, s_full))


@pytest.mark.parametrize("split", [2, 30, 64])
@torch.no_grad()
def test_split_prefill_matches_prefill(layers, split):
    _, ours = layers
    x = _x(seed=3)
    full, conv_full, s_full = ours(x)
    y1, conv, s = ours(x[:split])
    conv_snap, s_snap = conv.clone(), s.clone()
    y2, conv2, s2 = ours(x[split:], conv, s)
    _close((torch.cat([y1, y2]), full), (conv2, conv_full), (s2, s_full))
    # The states passed in are left as they were (a pool or a snapshot owns them).
    assert torch.equal(conv, conv_snap) and torch.equal(s, s_snap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(4)
    ref = hf.Qwen3_5RMSNormGated(24, eps=1e-6).to(dtype)
    ours = GatedRMSNorm(24, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(24, generator=gen) + 0.5)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, z = (torch.randn(10, 24, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(ours(x, z), ref(x, z))  # same casts in the same order: bit for bit
