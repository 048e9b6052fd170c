"""Mixture-of-experts families against transformers' own forward, on tiny random-weight
checkpoints that transformers writes (``save_pretrained``: the hub's tensor names).

Prefill (fresh, then on a cached prefix) and greedy decode steps, fp32, through the
normal loader; TP=2 (experts split along their intermediate dimension) and EP=2 (whole
experts per rank) in real gloo processes, identical to TP=1. No real MoE checkpoint can
be had here: these check the math and the loader, not quality on trained weights.
"""
from __future__ import annotations

import pytest
import torch

from distributed.parallel_state import TPGroup
from srt.model_executor.forward_batch import ForwardMode
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from test_distributed import PROMPTS, _Harness, run_world
from test_model_parity import _check_parity

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _config(kind: str):
    import transformers as tf

    if kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers), norm_topk_prob on
        return tf.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)
    if kind == "qwen3_moe_sparse_step":  # every second layer MoE, weights not renormalised
        return tf.Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                 norm_topk_prob=False, decoder_sparse_step=2, head_dim=16)
    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if kind == "qwen2_moe":  # shared expert with its sigmoid gate; q/k/v biases
        return tf.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False)
    raise KeyError(kind)


KINDS = ["qwen3_moe", "qwen3_moe_sparse_step", "mixtral", "qwen2_moe"]


def _save(kind: str, folder) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.5)  # HF zero-inits biases; make them matter
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {kind: _save(kind, root / kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_parity_with_transformers(kind, moe_dirs):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 1, 21, 4, 14)]
    _check_parity(moe_dirs[kind], prompts)


def test_layers_are_moe_or_dense_as_the_config_says(moe_dirs):
    from srt.layers.moe import SparseMoeBlock

    def kinds(d):
        model = load_model(ModelConfig.from_path(d), TPGroup(), torch.float32, "cpu")
        return [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]

    assert kinds(moe_dirs["qwen3_moe"]) == [True, False, True]
    assert kinds(moe_dirs["qwen3_moe_sparse_step"]) == [False, True, False]
    assert kinds(moe_dirs["mixtral"]) == [True, True, True]
    model = load_model(ModelConfig.from_path(moe_dirs["qwen2_moe"]), TPGroup(), torch.float32, "cpu")
    assert model.model.layers[0].mlp.shared_expert is not None


def _run(model_dir: str, tp: TPGroup, ep_size: int) -> list:
    """Logits of a prefill (all positions) and two greedy decode steps."""
    cfg = ModelConfig.from_path(model_dir)
    model = load_model(cfg, tp, torch.float32, "cpu", ep_size=ep_size)
    h = _Harness(model, cfg, tp.size, len(PROMPTS))
    seqs = list(range(len(PROMPTS)))
    out = [h.step(ForwardMode.EXTEND, PROMPTS, seqs)]
    last = out[0][torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1]
    for _ in range(2):
        last = h.step(ForwardMode.DECODE, [[t] for t in last.argmax(-1).tolist()], seqs)
        out.append(last)
    experts = model.model.layers[0].mlp.experts
    return [o.numpy() for o in out] + [(experts.num_local_experts, experts.intermediate_per_rank)]


def _sharded_worker(info, tp: TPGroup, world, dirs: list[str]) -> list:
    return [_run(d, tp, ep) for d in dirs for ep in (1, 2)]


@pytest.mark.timeout(150)
def test_tp2_and_ep2_match_tp1(moe_dirs):
    """Real processes, gloo: experts split (EP 1) and placed whole (EP 2) over 2 ranks."""
    dirs = [moe_dirs["qwen3_moe"], moe_dirs["qwen2_moe"]]
    results = run_world(_sharded_worker, 2, 1, dirs, deadline_s=130)
    for i, d in enumerate(dirs):
        ref = _run(d, TPGroup(), 1)
        experts, inter = ref[-1]
        for rank in (0, 1):
            for j, ep in enumerate((1, 2)):
                got = results[rank][2 * i + j]
                assert got[-1] == ((experts, inter // 2) if ep == 1 else (experts // 2, inter))
                for step, (g, r) in enumerate(zip(got[:-1], ref[:-1])):
                    err = abs(torch.from_numpy(g) - torch.from_numpy(r)).max().item()
                    assert err < 1e-5, f"{d} rank {rank} ep {ep} step {step}: max abs diff {err:.2e}"


def test_ep_size_is_refused_for_a_dense_model_and_odd_sizes(tiny_dir):
    from srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="has no experts"):
        load_model(ModelConfig.from_path(tiny_dir), TPGroup(), torch.float32, "cpu", ep_size=2)
    with pytest.raises(ValueError, match="--ep-size must be 1"):
        ServerArgs(model_path=tiny_dir, tp_size=2, ep_size=3)
