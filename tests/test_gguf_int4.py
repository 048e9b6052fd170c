"""The embedded 4-bit GGUF served in its own precision (srt/model_executor/gguf_int4.py):
the conversion keeps the file's Q4_1 codes and scales in checkpoint row order, each linear layer gets
them through the model's own loaders (TP shards, fused q/k/v and gate/up, padded heads),
the default start serves them and says so, --dtype still serves it dense, and the
perplexity stays within 0.5% of the file dequantized to bf16."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from srt.layers.cpu_int4_linear import int4_supported  # noqa: E402

pytestmark = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")


def _codes_file(model_dir):
    from safetensors import safe_open

    from srt.model_executor.gguf_int4_codes import GGUF_INT4_FILE

    return safe_open(os.path.join(model_dir, GGUF_INT4_FILE), framework="pt", device="cpu")


def test_the_conversion_keeps_every_q4_matrix_in_checkpoint_order(smollm2_dir):
    from srt.model_executor.model_loader import iter_safetensors

    dense = dict(iter_safetensors(smollm2_dir))  # the codes file is not a checkpoint tensor
    assert not any(k.endswith((".codes", ".scale", ".zero")) for k in dense)
    with _codes_file(smollm2_dir) as f:
        types = json.loads(f.metadata()["gguf_types"])
        assert json.loads(f.metadata()["left_out"]) == []
        q4 = sorted(k for k, t in types.items() if t == "Q4_1")
        assert len(q4) == 7 * 30 and types["model.embed_tokens.weight"] == "Q8_0"
        for name in (q4[0], "model.layers.7.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight"):
            codes = f.get_tensor(f"{name}.codes")
            scale, minv = (f.get_tensor(f"{name}.{p}").repeat_interleave(32, 1) for p in ("scale", "min"))
            assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.dtype == torch.float32
            # the file's fp16 scale and minimum in fp32: the dequantized weights exactly
            assert torch.equal(codes.float() * scale + minv, dense[name]), name


def test_rows_in_no_known_order_are_refused():
    from srt.model_executor.gguf_int4_codes import _in_checkpoint_order

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=g)
    d, m = torch.rand(8, 2, generator=g) / 8, -torch.rand(8, 2, generator=g)
    dense = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
    assert _in_checkpoint_order(codes, d, m, dense, "blk.0.ffn_up.weight", {}) is not None
    perm = torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])  # llama.cpp's q row order, 2 heads of 4 rows
    found = _in_checkpoint_order(codes[perm], d[perm], m[perm], dense, "blk.0.attn_q.weight",
                                 {"attn_q": 2, "attn_k": 2})
    assert found is not None and torch.equal(found[0], codes)
    shuffled = torch.tensor([3, 1, 0, 2, 7, 5, 4, 6])
    assert _in_checkpoint_order(codes[shuffled], d[shuffled], m[shuffled], dense, "blk.0.attn_q.weight",
                                {"attn_q": 2, "attn_k": 2}) is None


@pytest.mark.parametrize("tp_rank,gemv", [(0, "1"), (1, "1"), (0, "0")])
def test_each_tp_shard_holds_its_slice_of_the_codes(smollm2_dir, tp_rank, gemv, monkeypatch):
    """TP=2 (9 query heads padded to 10): every layer's int4 weight, read back through the
    kernel, is the rank's slice of the dense weight; with ``GRAMSYNC_CPU_GEMV=0`` (or a CPU
    without AVX512-BF16) torch's int4 kernel holds them."""
    monkeypatch.setenv("GRAMSYNC_CPU_GEMV", gemv)
    from distributed.parallel_state import TPGroup
    from srt.layers.cpu_int4_linear import Int4Weight
    from srt.layers.cpu_qgemv import PanelInt4, qgemv_available, quantized_linear
    from srt.layers.linear import _TPLinear
    from srt.model_executor.compiled.cache import cpu_flags
    from srt.model_executor.gguf_int4 import INT4_MAX_ROWS, PANEL_INT4_MAX_ROWS, load_gguf_int4
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import load_model

    torch.set_grad_enabled(False)
    model = load_model(ModelConfig.from_path(smollm2_dir), TPGroup(rank=tp_rank, size=2), torch.float32)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, _TPLinear) and ".layers.1." in n}
    dense = {n: m.weight.detach().clone() for n, m in layers.items()}
    assert load_gguf_int4(model, smollm2_dir, "[test]") == 30 * 4
    for name, m in layers.items():
        held = m.packed_weight
        ours = isinstance(held.quantized, PanelInt4)  # our GEMV (AVX512-BF16), else torch's kernel
        assert ours or isinstance(held.quantized, Int4Weight), name
        assert ours == (gemv == "1" and qgemv_available()), name
        amx = "amx_bf16" in cpu_flags()  # oneDNN's bf16 matmul takes over from 5 rows there
        assert held.max_rows == ((4 if amx else PANEL_INT4_MAX_ROWS) if ours else INT4_MAX_ROWS), name
        assert torch.equal(m.weight, dense[name])  # the dense rows stay for larger steps
        w = dense[name]
        back = quantized_linear(torch.eye(w.shape[1]), held.quantized, None).T
        assert back.shape == w.shape
        assert float((back - w).norm() / w.norm()) < 0.01, name


def test_a_layer_without_codes_leaves_the_model_dense(smollm2_dir, tmp_path):
    from safetensors.torch import save_file

    from srt.model_executor.gguf_int4 import load_gguf_int4
    from srt.model_executor.gguf_int4_codes import GGUF_INT4_FILE
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import load_model

    for name in os.listdir(smollm2_dir):
        if name != GGUF_INT4_FILE:
            os.symlink(os.path.join(smollm2_dir, name), tmp_path / name)
    with _codes_file(smollm2_dir) as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if ".layers.3.mlp.down_proj." not in k}
    save_file(kept, str(tmp_path / GGUF_INT4_FILE))
    model = load_model(ModelConfig.from_path(str(tmp_path)), dtype=torch.float32)
    with pytest.raises(ValueError, match="layers.3.mlp.down_proj has no Q4_0 / Q4_1 codes"):
        load_gguf_int4(model, str(tmp_path), "[test]")
    layer = model.model.layers[3].mlp.down_proj
    assert layer.packed_weight is None and not layer.weight.is_meta and layer.weight.dtype == torch.float32


def _scheduler(model_dir, tokenizer, dtype):
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.model_executor.model_config import ModelConfig
    from srt.scheduler.scheduler import Scheduler
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, random_seed=0, dtype=dtype, max_running_requests=4,
                      max_total_tokens=2048, disable_torch_compile=True)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(model_dir, None), tokenizer)


def test_the_default_serves_the_codes_within_half_a_percent_of_bf16(smollm2_dir, smollm2_tokenizer, caplog):
    from bench_offline import chat_prompts
    from bench_quant import TEXT, agreement, greedy, perplexity
    from srt.layers.cpu_int4_linear import Int4Weight
    from srt.layers.cpu_int8_linear import Int8Weight
    from srt.layers.cpu_qgemv import PanelInt4, PanelInt8, SmallBatchQuantized
    from srt.model_executor.gguf_int4 import codes_at_every_row
    from srt.tokenizer_utils import apply_chat_template

    torch.set_grad_enabled(False)
    ids = smollm2_tokenizer(TEXT.read_text())["input_ids"][:512]
    prompts = [apply_chat_template(smollm2_tokenizer, m) for m in chat_prompts(4)]
    bf16 = _scheduler(smollm2_dir, smollm2_tokenizer, "bfloat16")
    # --dtype: dense (oneDNN-packed where the CPU computes bf16 natively, else none)
    dense = bf16.runner.model.model.layers[0].mlp.down_proj.packed_weight
    assert dense is None or (isinstance(dense, torch.Tensor) and dense.dtype == torch.bfloat16), type(dense)
    want, want_out = perplexity(bf16, ids), greedy(bf16, prompts, 16, "bf16")
    del bf16
    exact = perplexity(_scheduler(smollm2_dir, smollm2_tokenizer, "float32"), ids)  # dequantized exactly
    with caplog.at_level(logging.INFO):
        q = _scheduler(smollm2_dir, smollm2_tokenizer, "auto")
    assert "weights: the GGUF's own 4-bit codes, int8 LM head" in caplog.text
    assert q.runner.gguf_int4 and q.runner._cpu_int4()
    held = q.runner.model.model.layers[0].self_attn.qkv_proj.packed_weight
    assert isinstance(held, SmallBatchQuantized) and isinstance(held.quantized, (Int4Weight, PanelInt4))
    assert held.dense is not None  # eager here: the dense rows oneDNN-packed beside the codes
    head = q.runner.model.lm_head.packed_weight
    assert isinstance(head, SmallBatchQuantized) and isinstance(head.quantized, (Int8Weight, PanelInt8))
    out = greedy(q, prompts, 16, "gguf")  # 4 rows a step: the codes
    assert codes_at_every_row(q.runner.model) == 30 * 4 + 1  # the perplexity's prefill too (and the int8 head)
    got = perplexity(q, ids)
    print(f"perplexity bf16-dequantized {want:.4f} fp32-dequantized {exact:.4f} gguf int4 {got:.4f} "
          f"({got / want - 1:+.3%}, {got / exact - 1:+.3%}); greedy agreement {agreement(out, want_out):.3f}")
    # Within 0.5% of the file dequantized exactly (fp32), and no more than 0.5% above the bf16
    # dequantization, which itself sits 0.3-0.4% above the exact one: the codes (the file's 4-bit
    # values, only the scales rounded to bf16) came out 0.54% below it on an AVX512-BF16 EPYC
    # (2026-12-04), 0.36% below on AVX2.
    assert got != want and abs(got / exact - 1) < 0.005 and got / want - 1 < 0.005, (got, want, exact)
    assert [len(o) for o in out] == [16] * 4


def test_the_compile_cache_is_keyed_by_the_weights(tmp_path):
    from srt.model_executor.compiled.cache import compile_cache_key
    from srt.server_args import ServerArgs

    (tmp_path / "config.json").write_text("{}")
    args = ServerArgs(model_path=str(tmp_path))
    keys = [compile_cache_key(args, str(tmp_path), torch.float32, 1, 0, 8, w) for w in ("checkpoint", "gguf-int4")]
    assert keys[0]["weights"] == "checkpoint" and keys[0] != keys[1]


def test_a_few_rows_run_the_codes_and_more_rows_the_dense_weight(smollm2_dir):
    """A GGUF's layer: steps of up to its ``max_rows`` rows read the codes (the int4 kernel's
    rounding), larger ones the dequantized weight (fp32 exactly); both close to the file."""
    from srt.layers.cpu_packed_linear import linear, pack_weight
    from srt.layers.cpu_qgemv import SmallBatchQuantized, quantized_linear
    from srt.model_executor.gguf_int4 import load_gguf_int4
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import load_model

    torch.set_grad_enabled(False)
    model = load_model(ModelConfig.from_path(smollm2_dir), dtype=torch.float32)
    load_gguf_int4(model, smollm2_dir, "[test]")
    layer = model.model.layers[2].mlp.down_proj
    held = layer.packed_weight
    most = held.max_rows
    x = torch.randn(most + 1, layer.weight.shape[1], generator=torch.Generator().manual_seed(0))
    dense = torch.nn.functional.linear(x, layer.weight)
    few, many = linear(x[:most], layer.weight, held), linear(x, layer.weight, held)
    assert torch.equal(few, quantized_linear(x[:most], held.quantized, None))
    assert torch.equal(many, dense)
    assert not torch.equal(few, dense[:most])
    assert float((few - dense[:most]).norm() / dense.norm()) < 0.01
    packed = SmallBatchQuantized(held.quantized, pack_weight(layer.weight), most)  # an eager step's layout
    assert torch.allclose(linear(x, layer.weight, packed), dense, rtol=1e-4, atol=1e-4)


def test_speculation_serves_the_gguf_dense(smollm2_dir):
    """Verify steps have several rows, which read the dequantized weights: with the codes at
    batch 1 a draft would be checked against other numbers than a plain step computes."""
    import types

    from srt.model_executor.gguf_int4 import gguf_int4_choice
    from srt.server_args import ServerArgs

    model = types.SimpleNamespace(has_experts=False, is_hybrid=False)  # only its kind is read
    use, why = gguf_int4_choice(ServerArgs(model_path=smollm2_dir), smollm2_dir, "cpu", model)
    assert use, why
    args = ServerArgs(model_path=smollm2_dir, speculative_algorithm="NGRAM")
    use, why = gguf_int4_choice(args, smollm2_dir, "cpu", model)
    assert not use and "--speculative-algorithm" in why
