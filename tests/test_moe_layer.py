"""srt/layers/moe against transformers' own MoE blocks (tiny random configs, CPU).

TP and EP are *simulated* here: each rank's block is built with ``TPGroup(rank=r, size=2)``
and no process group, its ``partial_forward`` (everything before the block's one
all-reduce) is computed in this process, and the partials are summed by hand in place of
the all-reduce (two processes would check no more of this layer, at a process start each).
That covers the sharding and the one-reduction math; the collective itself is tested in
tests/test_distributed.py, and a real two-process run of an MoE model belongs to the
model-level TP tests, not to this file.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from safetensors import safe_open
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from distributed.parallel_state import TPGroup
from srt.layers.moe import (FusedMoE, MoeSpec, SparseMoeBlock, is_moe_layer, moe_experts_torch,
                            moe_spec_from_config, select_experts)
from srt.layers.moe.experts_torch import moe_experts_grouped_mm, moe_experts_loop
from srt.layers.moe.router import routing_weights

H, I, S, E, K = 32, 16, 24, 8, 3  # hidden, expert intermediate, shared intermediate, experts, top-k
_DIMS = dict(hidden_size=H, num_experts_per_tok=K, vocab_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def _config(family: str, norm: bool = True):
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**_DIMS, num_experts=E, moe_intermediate_size=I, norm_topk_prob=norm)
    elif family == "qwen2_moe":
        cfg = Qwen2MoeConfig(**_DIMS, num_experts=E, moe_intermediate_size=I, norm_topk_prob=norm,
                             shared_expert_intermediate_size=S)
    elif family == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(**_DIMS, num_experts=E, moe_intermediate_size=I,
                                   shared_expert_intermediate_size=S, layer_types=["full_attention"] * 2)
    else:
        cfg = MixtralConfig(**_DIMS, num_local_experts=E, intermediate_size=I)
    cfg._experts_implementation = "eager"  # the loop in the modeling file (standalone blocks)
    return cfg


_HF_BLOCK = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
             "qwen3_5_moe": Qwen3_5MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock}
CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("qwen2_moe", True),
         ("qwen3_5_moe", True), ("mixtral", True)]


def _hf_block(family: str, norm: bool = True, seed: int = 0):
    block = _HF_BLOCK[family](_config(family, norm)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # the router starts at zeros: random weights, no ties
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _per_expert(state: dict, family: str) -> dict:
    """The block's state in the per-expert form save_pretrained / the hub write."""
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    for e in range(E):
        gate, up = state["experts.gate_up_proj"][e].split(I, dim=0)
        for name, t in zip(names, (gate, up, state["experts.down_proj"][e])):
            out[f"experts.{e}.{name}.weight"] = t
    return out


def _ours(family, hf, tp=TPGroup(), ep_size=1, fused=True, dtype=torch.float32):
    block = SparseMoeBlock(moe_spec_from_config(hf.experts.config), H, tp=tp, ep_size=ep_size,
                           params_dtype=dtype)
    state = hf.state_dict()
    for name, t in (state if fused else _per_expert(state, family)).items():
        block.load_weight(name, t)
    return block


def _x(t: int, seed: int = 1, dtype=torch.float32):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _hf_out(hf, x):
    with torch.no_grad():
        return hf(x[None]).reshape(x.shape)


@pytest.mark.parametrize("family,norm", CASES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per_expert"])
def test_block_matches_transformers_fp32(family, norm, fused):
    hf = _hf_block(family, norm)
    ours = _ours(family, hf, fused=fused)
    for t in (1, 7, 40):
        x = _x(t)
        torch.testing.assert_close(ours(x), _hf_out(hf, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,norm", CASES)
def test_router_matches_transformers(family, norm):
    hf = _hf_block(family, norm)
    x = _x(50)
    _, hf_weights, hf_ids = hf.gate(x)
    spec = moe_spec_from_config(_config(family, norm))
    weights, ids = select_experts(torch.nn.functional.linear(x, hf.gate.weight), K, spec.renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
    # bf16: the Qwen routers round the weights to the hidden dtype, Mixtral's stay fp32
    xb, gb = x.bfloat16(), hf.gate.weight.bfloat16()
    with torch.no_grad():
        hf.gate.weight.data = gb
        _, hf_wb, hf_ib = hf.gate(xb)
    wb, ib = select_experts(torch.nn.functional.linear(xb, gb), K, spec.renormalize)
    wb = routing_weights(wb, torch.bfloat16, spec.fp32_routing_weights)
    assert torch.equal(ib, hf_ib) and wb.dtype == hf_wb.dtype
    assert torch.equal(wb, hf_wb)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_loads_what_save_pretrained_writes(family):
    """A tiny full model's save_pretrained output, layer 0's MoE tensors by their saved names."""
    import transformers

    cfg = _config(family)
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[family]
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # outputs of order 1 (its init's std 0.02 would make atol 1e-5 lax)
        for p in model.model.layers[0].mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        prefix = "model.layers.0." + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            saved = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    assert "experts.0." + ("w1" if family == "mixtral" else "gate_proj") + ".weight" in saved
    ours = SparseMoeBlock(moe_spec_from_config(cfg), H)
    loaded = {ours.load_weight(k, t) for k, t in saved.items()}
    assert loaded == {n for n, _ in ours.named_parameters()}
    x = _x(9)
    torch.testing.assert_close(ours(x), _hf_out(model.model.layers[0].mlp, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,norm", [("qwen2_moe", True), ("mixtral", True), ("qwen3_moe", False)])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_two_rank_partials_sum_to_full(family, norm, mode):
    hf = _hf_block(family, norm)
    full = _ours(family, hf)
    ranks = [_ours(family, hf, tp=TPGroup(rank=r, size=2), ep_size=2 if mode == "ep" else 1,
                   fused=r == 0) for r in range(2)]  # rank 1 through the per-expert loaders
    moe = ranks[1].experts
    if mode == "ep":
        assert (moe.num_local_experts, moe.expert_offset, moe.intermediate_per_rank) == (E // 2, E // 2, I)
    else:
        assert (moe.num_local_experts, moe.expert_offset, moe.intermediate_per_rank) == (E, 0, I // 2)
    for t in (1, 13):
        x = _x(t, seed=t)
        with torch.no_grad():
            total = sum(r.partial_forward(x) for r in ranks)
        torch.testing.assert_close(total, full(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", [moe_experts_torch, moe_experts_loop, moe_experts_grouped_mm])
def test_tokens_hitting_no_local_expert(impl):
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 2 * I, H, generator=g), torch.randn(4, H, I, generator=g)
    x, w = _x(5), torch.rand(5, 2, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [9, 12], [2, 11]])  # this rank holds 4..7
    assert torch.equal(impl(x, w13, w2, w, ids, 4), torch.zeros_like(x))
    ids[4, 1] = 5  # only token 4's second slot is local (expert 5 -> local 1)
    out = impl(x, w13, w2, w, ids, 4)
    gate, up = (x[4] @ w13[1].T).chunk(2)
    expect = (torch.nn.functional.silu(gate) * up) @ w2[1].T * w[4, 1]
    assert torch.equal(out[:4], torch.zeros(4, H))
    torch.testing.assert_close(out[4], expect, atol=1e-5, rtol=1e-5)
    assert impl(x[:0], w13, w2, w[:0], ids[:0], 4).shape == (0, H)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_zero_and_one_token(family):
    hf = _hf_block(family)
    ours = _ours(family, hf)
    assert ours(_x(0)).shape == (0, H)
    ranks = [_ours(family, hf, tp=TPGroup(rank=r, size=2), ep_size=2) for r in range(2)]
    assert ranks[1].partial_forward(_x(0)).shape == (0, H)
    torch.testing.assert_close(ours(_x(1)), _hf_out(hf, _x(1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen2_moe", False), ("mixtral", True)])
def test_bf16(family, norm):
    """Against the same block in fp32 (loose), and against transformers in bf16: its default
    experts (grouped_mm: a token's k terms summed in fp32, as ours; bit-equal on the machine
    this was written on) within one bf16 step at |y| < 4, its eager loop (which sums in bf16)
    within a few."""
    hf = _hf_block(family, norm)
    ours32 = _ours(family, hf)
    ours = _ours(family, hf, dtype=torch.bfloat16)
    assert ours.experts.w13_weight.dtype == torch.bfloat16
    x = _x(33)
    y = ours(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ours32(x), atol=0.1, rtol=0.05)
    hf = hf.to(torch.bfloat16)
    eager = _hf_out(hf, x.bfloat16())
    torch.testing.assert_close(y, eager, atol=0.04, rtol=0)
    hf.experts.config._experts_implementation = "grouped_mm"
    torch.testing.assert_close(y, _hf_out(hf, x.bfloat16()), atol=2 ** -6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_loop(dtype):
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(dtype)
    w2 = torch.randn(E, H, I, generator=g).to(dtype)
    x = _x(21, dtype=dtype)
    w, ids = select_experts(torch.randn(21, E, generator=g), K, True)
    for offset in (0, 3):  # 3: some slots belong to another rank
        loop = moe_experts_loop(x, w13, w2, w, ids, offset)
        tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2 ** -6, rtol=1e-2)
        torch.testing.assert_close(moe_experts_grouped_mm(x, w13, w2, w, ids, offset), loop, **tol)


def test_bad_sharding_raises():
    tp2, tp4 = TPGroup(rank=0, size=2), TPGroup(rank=0, size=4)
    with pytest.raises(ValueError, match="ep_size=3 with tp_size=2"):
        FusedMoE(E, K, H, I, tp=tp2, ep_size=3)
    with pytest.raises(ValueError, match="ep_size=2 with tp_size=1"):
        FusedMoE(E, K, H, I, ep_size=2)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        FusedMoE(6, K, H, I, tp=tp4, ep_size=4)
    with pytest.raises(ValueError, match="moe_intermediate_size=18 is not divisible by tp_size=4"):
        FusedMoE(E, K, H, 18, tp=tp4)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        FusedMoE(E, 9, H, I)
    moe = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match="expects"):
        moe.load_expert_weight("0.gate_proj.weight", torch.zeros(I + 1, H))
    with pytest.raises(KeyError):
        moe.load_expert_weight("0.gate.weight", torch.zeros(I, H))


def test_spec_and_layer_rule():
    assert moe_spec_from_config(_config("mixtral")) == MoeSpec(E, K, I, True, 0, True)
    assert moe_spec_from_config(_config("qwen3_moe", False)) == MoeSpec(E, K, I, False, 0)
    assert moe_spec_from_config(_config("qwen2_moe", True)) == MoeSpec(E, K, I, True, S)
    assert moe_spec_from_config(_config("qwen3_5_moe")) == MoeSpec(E, K, I, True, S)
    from transformers import Qwen3_5MoeConfig  # the composite (vision + text) config

    composite = Qwen3_5MoeConfig(text_config=_config("qwen3_5_moe").to_dict())
    assert moe_spec_from_config(composite) == MoeSpec(E, K, I, True, S)
    assert is_moe_layer(composite, 1)
    cfg = Qwen2MoeConfig(**_DIMS, num_experts=E, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not is_moe_layer(Qwen3MoeConfig(**_DIMS, num_experts=0), 0)
    assert all(is_moe_layer(_config("mixtral"), i) for i in range(2))


def test_custom_op_compiles_fullgraph():
    hf = _hf_block("qwen2_moe")
    block = _ours("qwen2_moe", hf)
    torch.library.opcheck(torch.ops.gramsync.moe_experts.default,
                          (_x(4), block.experts.w13_weight, block.experts.w2_weight,
                           torch.rand(4, K), torch.randint(0, E, (4, K)), 0))

    def step(x):
        return block(x) * 2
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for t in (5, 5):
        x = _x(t, seed=t)
        torch.testing.assert_close(compiled(x), step(x), atol=1e-5, rtol=0)


def test_routing_digest_tells_routings_apart_and_skips_what_it_did_not_see():
    from srt.layers.moe.routing_digest import RoutingDigest, attach_routing_digest

    a, b = RoutingDigest(), RoutingDigest()
    assert a.pop() is None  # no step routed: the batch log writes no ROUTING line
    ids = torch.tensor([[0, 3], [2, 1]])
    a.add(ids)
    b.add(ids)
    assert a.pop() == b.pop() and a.pop() is None
    a.add(ids)
    b.add(torch.tensor([[0, 3], [1, 2]]))  # the same experts, another order for one token
    assert a.pop() != b.pop()
    assert attach_routing_digest(torch.nn.Linear(2, 2)) is None  # a dense model has none
