"""The oneDNN-packed linear layers of the eager CPU step (srt/layers/cpu_packed_linear.py):
the op equals F.linear up to rounding at every shape a step uses, a compiled step still
traces F.linear, and a ModelRunner packs exactly when its step runs eagerly on CPU.
Model-level parity with transformers through the packed path: test_model_parity.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed.parallel_state import TPGroup
from srt.layers.cpu_packed_linear import pack_weight, packed_linear, packing_supported
from srt.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=g)
    b = torch.randn(1536, generator=g) if with_bias else None
    x = torch.randn(rows, 576, generator=g)
    expect = F.linear(x, w, b)
    got = packed_linear(x, pack_weight(w), b)
    assert got.shape == expect.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-4)


def test_packed_linear_takes_3d_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(2, 5, 128, generator=g)[..., ::2]  # a strided view, as a split or slice gives
    assert not x.is_contiguous()
    torch.testing.assert_close(packed_linear(x, pack_weight(w), None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_layers_use_the_packed_weight_eagerly_and_f_linear_under_compile():
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, 96, bias=True, tp=TPGroup())
    row = RowParallelLinear(96, 64, bias=True, tp=TPGroup())
    for layer in (col, row):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 64)
    expect = row(col(x))
    col.packed_weight, row.packed_weight = pack_weight(col.weight), pack_weight(row.weight)
    torch.testing.assert_close(row(col(x)), expect, rtol=1e-5, atol=1e-4)

    # A stale packed weight shows which path ran: eager reads it, a traced graph must not.
    col.packed_weight = pack_weight(torch.zeros_like(col.weight))
    assert torch.count_nonzero(col(x) - col.bias) == 0
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    traced = torch.compile(col, backend=record, fullgraph=True)
    torch.testing.assert_close(traced(x), F.linear(x, col.weight, col.bias))
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes}
    assert not any("mkldnn" in op for op in ops), ops


def _runner(model_dir, **kwargs):
    from distributed.parallel_state import RankInfo
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, max_total_tokens=256, max_running_requests=2, dtype="float32", **kwargs)
    return ModelRunner(args, ModelConfig.from_path(model_dir), RankInfo(), TPGroup())


def _packed_count(runner) -> int:
    return sum(getattr(m, "packed_weight", None) is not None for m in runner.model.modules())


def test_model_runner_packs_when_eager_on_cpu_and_not_when_switched_off(tmp_path, monkeypatch):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    runner = _runner(str(tmp_path), disable_torch_compile=True)
    assert _packed_count(runner) == 4 * 2 + 1
    # Dense copies of the linear layers are dropped; the LM head's (the tied embedding) stays.
    dense = {n for n, p in runner.model.named_parameters() if p.device.type == "cpu" and p.dim() == 2}
    assert dense == {"model.embed_tokens.weight", "lm_head.weight"} or dense == {"model.embed_tokens.weight"}, dense
    monkeypatch.setenv("GRAMSYNC_CPU_PACKED_LINEAR", "0")
    assert _packed_count(_runner(str(tmp_path), disable_torch_compile=True)) == 0


def _codes_layer(max_rows: int):
    """A column layer holding a GGUF-style codes weight (torch's int4 op) for up to
    ``max_rows`` rows beside its dense fp32 weight, as gguf_int4.py leaves it."""
    from srt.layers.cpu_int4_linear import int4_from_codes, int4_supported
    from srt.layers.cpu_qgemv import SmallBatchQuantized

    if not int4_supported():
        pytest.skip("torch without its CPU int4 kernel")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 64), generator=g, dtype=torch.uint8)
    scale, zero = torch.rand(96, 2, generator=g) / 8, torch.randn(96, 2, generator=g) / 8
    layer = ColumnParallelLinear(64, 96, bias=False, tp=TPGroup())
    layer.weight.copy_((codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1))
    layer.packed_weight = SmallBatchQuantized(int4_from_codes(codes, scale, zero, 32), None, max_rows)
    return layer


def _ops(compiled_layer, x) -> set[str]:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(compiled_layer, backend=record, dynamic=True)(x)
    return y, {str(n.target) for gm in graphs for n in gm.graph.nodes}


def test_a_graph_of_any_row_count_reads_the_codes_layers_packed_dense_rows():
    """The compiled prefill's halves (rows dynamic, unbounded) take the packed dense rows
    through gramsync::onednn_linear; a decode graph whose rows are known to exceed the
    codes' limit keeps F.linear (freezing packs it); a few rows keep the codes."""
    from srt.layers.weight_packing import pack_linear_weights

    layer = _codes_layer(max_rows=4)
    dense_weight = layer.weight
    assert pack_linear_weights(layer, torch.float32, "[test]", compiled=True) == 1
    assert layer.weight is dense_weight and layer.weight.device.type == "cpu"  # the decode graphs read it
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    expect = packed_linear(x, layer.packed_weight.dense, None)
    y, ops = _ops(layer, x)
    assert "gramsync.onednn_linear" in ops, ops
    assert torch.equal(y, expect)

    decode_rows = x.clone()
    torch._dynamo.mark_dynamic(decode_rows, 0, min=5, max=16)
    y, ops = _ops(layer, decode_rows)
    assert not any("onednn" in op or "mkldnn" in op for op in ops), ops
    torch.testing.assert_close(y, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)

    few = x[:3].clone()
    torch._dynamo.mark_dynamic(few, 0, min=2, max=4)
    _, ops = _ops(layer, few)
    assert not any("onednn" in op for op in ops) and any("int4" in op for op in ops), ops


def test_inductor_compiles_the_packed_dense_rows_to_the_eager_result():
    """The same op through Inductor (the served prefill): bit-equal to the eager step."""
    from srt.layers.weight_packing import pack_linear_weights

    layer = _codes_layer(max_rows=4)
    pack_linear_weights(layer, torch.float32, "[test]", compiled=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True)
    for rows in (7, 38):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            assert torch.equal(compiled(x), layer(x))  # eager: packed_linear on the same packing
            assert torch.equal(layer(x), packed_linear(x, layer.packed_weight.dense, None))


def test_packing_for_a_compiled_model_leaves_plain_layers_to_the_compiler():
    from srt.layers.weight_packing import pack_linear_weights

    plain = ColumnParallelLinear(64, 96, bias=False, tp=TPGroup())
    assert pack_linear_weights(plain, torch.float32, "[test]", compiled=True) == 0
    assert plain.packed_weight is None
