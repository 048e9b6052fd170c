"""gramsync's decode-attention op (srt/layers/cpu_decode_attention.cpp) against the torch path.

The op reads each row's keys and values in place from a layer's KV pool through the slot
table; the torch path (decode_attention_torch) gathers them and runs two matmuls. Checked
against that path run in float64 over the shapes decode meets (one row to past 16, one key
to a thousand, a row's keys split across threads and rejoined, padded rows, GQA groups of 1, 3 and 8, a head size that is not a multiple of
the 16-lane block, q as a strided view), then its errors, then the routing: eager and
exported graphs call it, ``GRAMSYNC_CPU_DECODE_ATTENTION=0`` keeps the torch path. The real
model's package (op + GEMV) is checked against the torch path in test_aoti_decode.py.
"""
from __future__ import annotations

import pytest
import torch

from srt.layers.attention import torch_native
from srt.layers.cpu_kernels import load_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def library():
    if not load_cpu_kernels():
        pytest.skip("gramsync's CPU kernels cannot be built here (no C++ compiler)")


def _case(B, S, H, KVH, D, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KVH, N, D, generator=g).to(dtype)
    v = torch.randn(KVH, N, D, generator=g).to(dtype)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    lens = torch.randint(1, S + 1, (B,), generator=g)
    lens[0] = S
    valid = torch.arange(S).unsqueeze(0) < lens.unsqueeze(1)
    slots = torch.randint(0, N, (B, S), generator=g)
    return q, k, v, torch.where(valid, slots, slots[:, :1]), valid


def _reference(q, k, v, slots, valid, scaling):
    return torch_native.decode_attention_torch(q.double(), k.double(), v.double(), slots, valid, k.shape[0], scaling)


def _check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    # fp32: summation order only. bf16: one rounding of an fp32 result (2^-8 relative).
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S", [(1, 1), (1, 64), (2, 37), (4, 128), (16, 128), (17, 300), (1, 700), (2, 1100)])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 4, 24), (16, 2, 128)])
def test_op_matches_the_torch_path_in_float64(dtype, B, S, H, KVH, D):
    q, k, v, slots, valid = _case(B, S, H, KVH, D, 1000, dtype, seed=B * 1000 + S)
    out = torch.ops.gramsync.decode_attention(q, k, v, slots, valid, D ** -0.5)
    _check(out, _reference(q, k, v, slots, valid, D ** -0.5), dtype)


def test_op_takes_q_as_a_strided_view():
    q, k, v, slots, valid = _case(5, 40, 9, 3, 64, 300, torch.float32, seed=7)
    qkv = torch.cat([q, torch.randn(5, 9, 64)], dim=1)  # q a view with a row stride of 18 heads
    out = torch.ops.gramsync.decode_attention(qkv[:, :9], k, v, slots, valid, 0.125)
    _check(out, _reference(q, k, v, slots, valid, 0.125), torch.float32)


def test_op_refuses_what_it_cannot_run_with_a_clear_error():
    q, k, v, slots, valid = _case(2, 8, 9, 3, 64, 50, torch.float32, seed=1)
    op = torch.ops.gramsync.decode_attention
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.double(), k.double(), v.double(), slots, valid, 0.1)
    with pytest.raises(RuntimeError, match="CPU tensors of one dtype"):
        op(q, k.bfloat16(), v, slots, valid, 0.1)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 8, 64), k, v, slots, valid, 0.1)  # 8 heads over 3 kv heads
    with pytest.raises(RuntimeError, match=r"must both be \[B, S\]"):
        op(q, k, v, slots.int(), valid, 0.1)
    bad = slots.clone()
    bad[1, 0] = 50
    with pytest.raises(RuntimeError, match="slot 50 outside the pool of 50"):
        op(q, k, v, bad, valid, 0.1)
    bad[1, 0], valid[1, 0] = -1, False  # a masked slot is never read, so never checked
    op(q, k, v, bad, valid, 0.1)
    q, k, v, slots, valid = _case(2, 40, 9, 3, 64, 50, torch.float32, seed=2)  # in a block of 16 keys too
    valid[1, 20:] = False
    slots[1, 20:] = -(10 ** 12)
    _check(op(q, k, v, slots, valid, 0.1), _reference(q, k, v, slots.clamp(min=0), valid, 0.1), torch.float32)


def test_eager_decode_uses_the_op_unless_switched_off(monkeypatch):
    q, k, v, slots, valid = _case(3, 20, 9, 3, 64, 100, torch.float32, seed=3)
    calls = []
    real = torch.ops.gramsync.decode_attention

    class Spy:  # counts calls to the real op, and returns its result
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

    monkeypatch.setattr(torch.ops.gramsync, "decode_attention", Spy())
    out = torch_native.decode_attention(q, k, v, slots, valid, 3, 0.125)
    assert calls == [1]
    monkeypatch.setenv("GRAMSYNC_CPU_DECODE_ATTENTION", "0")
    again = torch_native.decode_attention(q, k, v, slots, valid, 3, 0.125)
    assert calls == [1]  # the torch path
    torch.testing.assert_close(out, again, rtol=1e-5, atol=1e-6)


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, slots, valid):
        return torch_native.decode_attention(q, k, v, slots, valid, 3, 0.125)


def _exported_targets(args) -> list[str]:
    program = torch.export.export(_Attend(), args)
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_exported_graphs_call_the_op_unless_switched_off(monkeypatch):
    args = _case(2, 16, 9, 3, 64, 64, torch.float32, seed=5)
    assert _exported_targets(args).count("gramsync.decode_attention.default") == 1
    monkeypatch.setenv("GRAMSYNC_CPU_DECODE_ATTENTION", "0")
    targets = _exported_targets(args)
    assert "gramsync.decode_attention.default" not in targets and "aten.index_select.default" in targets
