"""Hybrid Gated DeltaNet families (Qwen3.5 dense and MoE, Qwen3-Next, and Qwen3.5's released
``ForConditionalGeneration`` layout) against transformers' own forward, on tiny random-weight
checkpoints that transformers writes (the hub's tensor names).

Prompts longer than the 64-token chunk of the chunked delta rule; prefill fresh, then on a
carried state (the last 3 prompt tokens), then batched greedy decode steps, fp32. No real
hybrid checkpoint can be had here: these check the math and the loader, not quality on
trained weights.
"""
from __future__ import annotations

import pytest
import torch

from distributed.parallel_state import TPGroup
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from test_model_parity import _check_parity

TEXT = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, tie_word_embeddings=False, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


def hybrid_config(kind: str):
    import transformers as tf

    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**TEXT, intermediate_size=96), "Qwen3_5ForCausalLM"
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**TEXT, **MOE), "Qwen3_5MoeForCausalLM"
    if kind == "qwen3_next":  # layer 1 dense (mlp_only_layers); routing renormalised
        return (tf.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=80, mlp_only_layers=[1],
                                   norm_topk_prob=True), "Qwen3NextForCausalLM")
    if kind == "qwen3_5_vl":  # the released layout: text under model.language_model, a vision tower
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        return (tf.Qwen3_5Config(text_config={**TEXT, "intermediate_size": 96}, vision_config=vision),
                "Qwen3_5ForConditionalGeneration")
    raise KeyError(kind)


KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl"]


def save_hybrid(kind: str, folder) -> str:
    import transformers as tf

    config, arch = hybrid_config(kind)
    torch.manual_seed(0)
    cls = getattr(tf, arch)
    hf = cls._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # (1 + w) norms are zero-initialised and the GDN's gated norm at one: make them matter.
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3).add_(1.0 if ".linear_attn.norm." in name else 0.0)
    hf.config.architectures = [arch]
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {kind: save_hybrid(kind, root / kind) for kind in KINDS}


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (70, 1, 150, 9, 131)]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_parity_with_transformers(kind, hybrid_dirs):
    _check_parity(hybrid_dirs[kind], _prompts(), max_ctx=256)


def test_conditional_generation_layout_serves_its_text_decoder(hybrid_dirs, caplog):
    """The released checkpoints' layout: names under model.language_model., the vision tower
    skipped and said so; logits equal transformers' text decoder on the same weights."""
    import transformers as tf
    from safetensors.torch import load_file

    d = hybrid_dirs["qwen3_5_vl"]
    with caplog.at_level("INFO"):
        cfg = ModelConfig.from_path(d)
        load_model(cfg, TPGroup(), torch.float32, "cpu")
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.num_hidden_layers == 4
    assert "skipped from the checkpoint: visual" in caplog.text
    # The reference: transformers' text-only model with the same text weights.
    import glob
    import os
    tensors = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        tensors.update(load_file(f))
    assert any(k.startswith("model.visual.") for k in tensors)
    text = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
            for k, v in tensors.items() if not k.startswith("model.visual.")}
    ref = tf.Qwen3_5ForCausalLM(cfg.hf_config).eval()
    missing, unexpected = ref.load_state_dict(text, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out = os.path.join(d, "text_only")
    ref.config.architectures = ["Qwen3_5ForCausalLM"]
    ref.save_pretrained(out)
    _check_parity(out, _prompts()[:3], max_ctx=256)
    from test_model_parity import _Runner
    from srt.model_executor.forward_batch import ForwardMode
    vl = load_model(ModelConfig.from_path(d), TPGroup(), torch.float32, "cpu")
    txt = load_model(ModelConfig.from_path(out), TPGroup(), torch.float32, "cpu")
    p = _prompts()[2]
    a = _Runner(vl, cfg, 1, max_ctx=256).step(ForwardMode.EXTEND, [p], [0])
    b = _Runner(txt, cfg, 1, max_ctx=256).step(ForwardMode.EXTEND, [p], [0])
    assert torch.equal(a, b)


def test_layer_kinds_and_pool_indices_follow_layer_types(hybrid_dirs):
    from srt.layers.moe import SparseMoeBlock

    model = load_model(ModelConfig.from_path(hybrid_dirs["qwen3_next"]), TPGroup(), torch.float32, "cpu")
    layers = model.model.layers
    assert [layer.state_index for layer in layers] == [0, 1, 2, None]  # L L L F
    assert layers[3].self_attn.attn.layer_id == 0 and model.attention_layer_count() == 1
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True, True]
    assert len(model.linear_layers()) == 3


def _decode_rows(run, rows: list[tuple[int, int]]):
    """One DECODE batch whose rows are ``(seq, token)``; a sequence's several rows are
    consecutive, each one position further (the scheduler's grammar fast-forward rows)."""
    from srt.layers.linear_attention.state_batch import build_state_batch
    from srt.model_executor.forward_batch import ForwardBatch, ForwardMode

    ids, pos, locs, lens, prefix, pool_rows = [], [], [], [], [], []
    for sid, tok in rows:
        slot = run.kv_alloc.alloc(1)
        start = run.lens[sid]
        run.req_pool.req_to_token[run.rows[sid], start] = slot
        run.lens[sid] += 1
        ids.append(tok), pos.append(start), locs.append(slot)
        lens.append(start + 1), prefix.append(start), pool_rows.append(run.rows[sid])
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.tensor(ids), positions=torch.tensor(pos),
        out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor(pool_rows), seq_lens=torch.tensor(lens),
        seq_lens_cpu=lens, extend_seq_lens_cpu=[1] * len(rows), extend_prefix_lens_cpu=prefix,
        req_to_token_pool=run.req_pool, token_to_kv_pool=run.kv_pool, return_all_logits=True)
    fb.linear_state = build_state_batch(fb, run.state_pool)
    return run.model(fb)


def test_several_decode_rows_of_one_request_run_in_order(hybrid_dirs):
    """Fast-forward / draft rows: a request's 3 rows in one step (token by token through the
    recurrence) give the logits of 3 decode steps; the other request's single row is unchanged."""
    from srt.model_executor.forward_batch import ForwardMode
    from test_model_parity import _Runner

    d = hybrid_dirs["qwen3_5"]
    cfg = ModelConfig.from_path(d)
    model = load_model(cfg, TPGroup(), torch.float32, "cpu")
    prompts = _prompts()[:2]
    runs = [_Runner(model, cfg, 2, max_ctx=256) for _ in range(2)]
    for run in runs:
        run.step(ForwardMode.EXTEND, prompts, [0, 1])
    a, b = runs
    steps = [_decode_rows(a, [(0, t), (1, 7)]) if i == 0 else _decode_rows(a, [(0, t)])
             for i, t in enumerate((11, 12, 13))]
    together = _decode_rows(b, [(0, 11), (0, 12), (0, 13), (1, 7)])
    want = torch.cat([steps[0][:1], steps[1], steps[2], steps[0][1:]])
    # Not bit for bit: the projections see 3 rows instead of 1 (another GEMM shape), and
    # oneDNN's fp32 kernels for the two shapes differ by CPU: 1.7e-5 on a Xeon with AMX
    # (2026-12-05), under 1e-5 on AMD EPYC. A wrong order or a lost row is O(1).
    assert (together - want).abs().max().item() < 5e-5
    for pool in ("recurrent", "conv"):
        x, y = getattr(a.state_pool, pool)[:, a.rows[0]], getattr(b.state_pool, pool)[:, b.rows[0]]
        assert (x - y).abs().max().item() < 5e-5, pool
