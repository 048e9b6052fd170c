"""The speed paths' small parts: the compiled (fused, in-place) decode attention against
the eager one, backend and flag validation, and torchao int8 weight-only quantization."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.layers.attention import create_attention_backend
from srt.model_executor.forward_batch import ForwardMode
from srt.layers.attention.torch_native import DECODE_KEY_BUCKET, TorchNativeAttnBackend, decode_attention
from srt.server_args import ServerArgs


def _decode_case(batch: int, seq: int, dtype=torch.float32):
    torch.manual_seed(0)
    kvh, heads, d, pool = 2, 6, 32, 400
    layer = SimpleNamespace(layer_id=0, num_kv_heads=kvh, num_heads=heads, head_dim=d, scaling=d ** -0.5)
    kb, vb = torch.randn(kvh, pool, d, dtype=dtype), torch.randn(kvh, pool, d, dtype=dtype)
    kb[:, 0] = vb[:, 0] = float("nan")  # the dummy slot: padding must never read it
    lens = torch.randint(1, seq + 1, (batch,))
    lens[0] = seq
    slots = (torch.randperm(pool - 1)[: batch * seq] + 1).view(batch, seq)
    valid = torch.arange(seq)[None] < lens[:, None]
    fb = SimpleNamespace(token_to_kv_pool=SimpleNamespace(k_buffer=[kb], v_buffer=[vb]),
                         decode_kv_slots=torch.where(valid, slots, slots[:, :1]), decode_kv_valid=valid,
                         decode_attention=None)
    return layer, fb, torch.randn(batch, heads, d, dtype=dtype), slots, lens


def test_compiled_decode_attention_matches_eager_and_reference():
    """Decode attention compiled (dynamic shapes, as in the compiled step) == eager == SDPA."""
    backend = TorchNativeAttnBackend()
    compiled = torch.compile(lambda q, layer, fb: backend.forward_decode(q, layer, fb), dynamic=True)
    kernel = torch.compile(decode_attention, dynamic=True)
    for batch, seq in ((3, 17), (5, 40)):  # two shapes: the dynamic graph is reused
        layer, fb, q, slots, lens = _decode_case(batch, seq)
        with torch.inference_mode():
            eager = backend.forward_decode(q, layer, fb)
            fused = compiled(q, layer, fb)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
        # The kernel alone, compiled once for every layer (a MIXED step's decode rows).
        fb.decode_attention = kernel
        with torch.inference_mode():
            torch.testing.assert_close(backend.forward_decode(q, layer, fb), eager, rtol=1e-5, atol=1e-5)
        fb.decode_attention = None
        for b in range(batch):  # and both == SDPA over each sequence's own keys
            s = slots[b, : lens[b]]
            k, v = fb.token_to_kv_pool.k_buffer[0][:, s][None], fb.token_to_kv_pool.v_buffer[0][:, s][None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b].view(1, 6, 1, 32), k, v, scale=layer.scaling, enable_gqa=True)
            torch.testing.assert_close(eager[b], ref.view(6, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])  # one row computes in fp32, more in the pool's dtype
def test_decode_key_table_is_padded_to_the_bucket_and_padding_is_never_read(dtype, batch):
    """The slot table is rounded up to DECODE_KEY_BUCKET keys (stable matmul shapes); the
    padding (never-written slots here: NaN) changes nothing against SDPA per sequence."""
    torch.manual_seed(0)
    kvh, heads, d, pool, width = 2, 6, 32, 400, 150
    layer = SimpleNamespace(layer_id=0, num_kv_heads=kvh, num_heads=heads, head_dim=d, scaling=d ** -0.5)
    kb, vb = torch.randn(kvh, pool, d, dtype=dtype), torch.randn(kvh, pool, d, dtype=dtype)
    kb[:, 0] = vb[:, 0] = float("nan")  # every table entry past a sequence's end points here
    lens = torch.tensor([70, 5, 33][:batch])
    req_to_token = torch.zeros(batch, width, dtype=torch.int64)
    for b in range(batch):
        req_to_token[b, : lens[b]] = torch.randperm(pool - 1)[: lens[b]] + 1
    fb = SimpleNamespace(mode=ForwardMode.DECODE, decode_kv_slots=None, seq_lens_cpu=lens.tolist(), seq_lens=lens,
                         req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                         req_pool_indices=torch.arange(batch), decode_attention=None,
                         token_to_kv_pool=SimpleNamespace(k_buffer=[kb], v_buffer=[vb]))
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(fb)
    assert fb.decode_kv_slots.shape == (batch, 2 * DECODE_KEY_BUCKET) == fb.decode_kv_valid.shape
    assert fb.decode_kv_valid.sum(1).tolist() == lens.tolist()
    q = torch.randn(batch, heads, d, dtype=dtype)
    with torch.inference_mode():
        out = backend.forward_decode(q, layer, fb)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b in range(batch):
        s = req_to_token[b, : lens[b]]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b].float().view(1, heads, 1, d), kb[:, s][None].float(), vb[:, s][None].float(),
            scale=layer.scaling, enable_gqa=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[b].float(), ref.view(heads, d), rtol=tol, atol=tol)
    # A table never grows past req_to_token's width, whatever the bucket.
    fb.decode_kv_slots, fb.seq_lens_cpu = None, [width] + lens.tolist()[1:]
    backend.init_forward_metadata(fb)
    assert fb.decode_kv_slots.shape[1] == width


def test_attention_backend_choice_is_validated():
    assert create_attention_backend("auto", "cpu").name == "torch_native"
    assert create_attention_backend("torch_native", "cpu").name == "torch_native"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="Unknown --attention-backend"):
        create_attention_backend("flashmagic", "cpu")


def test_speed_flags_are_validated():
    with pytest.raises(ValueError, match="exclude each other"):
        ServerArgs(enable_torch_compile=True, disable_torch_compile=True)
    with pytest.raises(ValueError, match="torch-compile-max-bs"):
        ServerArgs(torch_compile_max_bs=0)
    with pytest.raises(ValueError, match="int8wo"):
        ServerArgs(torchao_config="int3wo")
    assert ServerArgs(torchao_config="int4wo-128").torchao_config == "int4wo-128"


def test_int8wo_quantizes_every_decoder_linear_and_stays_close():
    pytest.importorskip("torchao")
    from srt.layers.quantization import apply_torchao_config
    from srt.layers.linear import RowParallelLinear

    layer = RowParallelLinear(256, 128, params_dtype=torch.float32)
    layer.weight.data.normal_(0, 0.05)
    x = torch.randn(3, 256)
    ref = layer(x)
    holder = torch.nn.Sequential(layer)
    apply_torchao_config(holder, "int8wo", "cpu")
    assert "Int8" in type(layer.weight.data).__name__  # torchao's int8 weight tensor
    out = layer(x)
    assert out.shape == ref.shape
    # int8 per-row scales: error well under 1% of the output scale, but not zero (quantized).
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.01 * ref.abs().max().item()


def test_int4wo_on_cpu_runs_torchs_int4_kernel_and_stays_close():
    """int4 (group 32) through torch's CPU kernel: the weight the kernel applies (read back
    by multiplying the identity) is within half a quantization step of the dense weight in
    every group of 32 inputs, and the layer's output is the bf16-rounded input times that
    weight plus the bias."""
    pytest.importorskip("torchao")
    from srt.layers.cpu_int4_linear import Int4Weight, int4_linear
    from srt.layers.linear import ColumnParallelLinear
    from srt.layers.quantization import apply_torchao_config

    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 96, bias=True, params_dtype=torch.float32)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.1)
    dense, x = layer.weight.detach().clone(), torch.randn(3, 256)
    ref = layer(x)
    apply_torchao_config(torch.nn.Sequential(layer), "int4wo-32", "cpu")
    assert isinstance(layer.packed_weight, Int4Weight) and layer.weight.is_meta
    applied = int4_linear(torch.eye(256), layer.packed_weight, None).t()  # [96, 256]
    groups = dense.view(96, 8, 32)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 15 / 2).unsqueeze(-1)
    assert ((applied.view(96, 8, 32) - groups).abs() <= half_step * 1.05 + 1e-3).all()
    assert not torch.equal(applied, dense)  # quantized
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    want = x.to(torch.bfloat16).float() @ applied.t() + layer.bias
    assert (out - want).abs().max().item() < 1e-2 * want.abs().max().item()


def test_int8_head_kernel_applies_the_row_scaled_weight():
    """The int8 LM head of an int4 model on CPU: the weight the kernel applies (read back
    through the identity) is within half a quantization step of the dense one in every
    row (up to bf16 rounding), and an fp32 model's head gets bf16-rounded inputs and gives fp32 back."""
    from srt.layers.cpu_int8_linear import int8_linear, quantize_int8

    torch.manual_seed(0)
    dense = torch.randn(200, 64) * 0.05
    w = quantize_int8(dense)
    assert w.qdata.dtype == torch.int8 and w.qdata.abs().max().item() == 127
    applied = int8_linear(torch.eye(64), w, None).t()  # [200, 64]
    half_step = (dense.abs().amax(1, keepdim=True) / 127 / 2)
    bf16_rounding = dense.abs() * 2 ** -7  # the bf16 scale and the bf16 output
    assert ((applied - dense).abs() <= half_step + bf16_rounding).all()
    assert not torch.equal(applied, dense)
    x = torch.randn(3, 64)
    out = int8_linear(x, w, None)
    assert out.dtype == torch.float32 and out.shape == (3, 200)
    want = x.to(torch.bfloat16).float() @ applied.t()
    assert (out - want).abs().max().item() < 1e-2 * want.abs().max().item()


def test_int4wo_group_must_divide_the_inputs():
    pytest.importorskip("torchao")
    from srt.layers.linear import ColumnParallelLinear
    from srt.layers.quantization import apply_torchao_config

    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        apply_torchao_config(torch.nn.Sequential(ColumnParallelLinear(576, 8, params_dtype=torch.float32)),
                             "int4wo-128", "cpu")


@pytest.mark.parametrize("batch, matmul_dtype", [(3, torch.float32), (16, torch.float32), (17, torch.bfloat16)])
def test_compiled_small_batches_run_attention_matmuls_in_fp32(batch, matmul_dtype):
    """The torch decode-attention path (the fallback of gramsync's op, and its reference): in a
    compiled step up to FP32_ATTENTION_MAX_ROWS rows (the small-batch graphs) its
    two attention matmuls of a bf16 model run in fp32 (faster at these shapes, docs/speed-history.md);
    larger batches keep bf16. The traced graph is read: which dtype each matmul got."""
    import srt.layers.attention.torch_native as native

    assert native.FP32_ATTENTION_MAX_ROWS == 16
    seen: list[torch.dtype] = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (torch.matmul, torch.bmm):
                seen.append(node.meta["example_value"].dtype)
        return gm.forward

    torch._dynamo.reset()
    layer, fb, q, _, _ = _decode_case(batch, 20, torch.bfloat16)
    fb.token_to_kv_pool.k_buffer[0][:, 0] = 0  # bf16 NaN padding is irrelevant here
    fb.token_to_kv_pool.v_buffer[0][:, 0] = 0
    args = (q, fb.token_to_kv_pool.k_buffer[0], fb.token_to_kv_pool.v_buffer[0], fb.decode_kv_slots,
            fb.decode_kv_valid, layer.num_kv_heads, layer.scaling)
    with torch.inference_mode():
        out = torch.compile(native.decode_attention_torch, backend=record, dynamic=True)(*args)
        eager = native.decode_attention_torch(*args)  # eager: bf16 matmuls from 2 rows
    assert seen == [matmul_dtype, matmul_dtype]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_small_batch_graphs_leave_the_cpp_gemm_template_out_only_for_bf16_without_amx():
    """bf16 on AVX512-BF16 without AMX: oneDNN alone (the template's fp32-widening bf16
    kernel lost the batch-1 step, 13.4 vs 10.0 ms); with AMX, and in fp32, the template
    stays a max-autotune candidate. The graphs of a real CompiledDecode get these options."""
    import srt.model_executor.compiled.decode as cd

    assert cd.small_batch_options(torch.bfloat16, ["avx2", "avx512_bf16"])["max_autotune_gemm_backends"] == "ATEN"
    assert cd.small_batch_options(torch.bfloat16, ["avx512_bf16", "amx_bf16"])["max_autotune_gemm_backends"] == "CPP,ATEN"
    assert cd.small_batch_options(torch.float32, ["avx2"])["max_autotune_gemm_backends"] == "CPP,ATEN"
    # A CPU int4 model (int4 decoder, int8 head) has no dense GEMM: the template stays.
    assert cd.small_batch_options(torch.bfloat16, ["avx512_bf16"], dense=False)["max_autotune_gemm_backends"] \
        == "CPP,ATEN"
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Linear(4, 4).to(dtype)
        graphs = cd.CompiledDecode(model, 32, "[test]")._graphs
        want = cd.small_batch_options(dtype, cd.cpu_flags())
        # bf16 with AMX: the GEMVs' graph ends at 4 rows, oneDNN's begins at 5.
        small = [("2-4", want), ("5-16", want)] if dtype == torch.bfloat16 and "amx_bf16" in cd.cpu_flags() \
            else [("2-16", want)]
        assert [(g.label, g.options) for g in graphs] == [("1", want), *small, ("17-32", cd._FREEZE)]
    from srt.layers.cpu_int4_linear import Int4Weight
    from srt.layers.cpu_int8_linear import Int8Weight
    from srt.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(4, 4, params_dtype=torch.bfloat16)
    assert cd._has_dense_linear(layer)
    layer.packed_weight = Int8Weight(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4), 4)
    assert not cd._has_dense_linear(layer)
    layer.packed_weight = Int4Weight(torch.zeros(1), torch.zeros(1), 32, 4)
    assert not cd._has_dense_linear(torch.nn.Sequential(layer, torch.nn.Linear(4, 4)))
    from srt.layers.cpu_qgemv import SmallBatchQuantized

    # Quantized in every small graph (up to 16 rows): no dense GEMM there; only in batch 1: dense.
    layer.packed_weight = SmallBatchQuantized(layer.packed_weight, None, 16)
    assert not cd._has_dense_linear(layer)
    layer.packed_weight = SmallBatchQuantized(layer.packed_weight.quantized, None, 4)
    assert cd._has_dense_linear(layer)


@pytest.mark.parametrize("amx", [False, True])
def test_with_amx_the_gemvs_graph_ends_at_4_rows_and_onednn_takes_5_to_16(amx, monkeypatch):
    """bf16 on an AMX CPU: the GEMVs (dense, the GGUF's codes, the int8 head) serve up to 4
    rows, a graph of their own; 5-16 rows get a graph where oneDNN's matmul runs. fp32 and
    CPUs without AMX keep one 2-16 graph."""
    import srt.model_executor.compiled.cache as cache
    import srt.model_executor.compiled.decode as cd
    from srt.layers.cpu_gemv import gemv_max_rows

    flags = ["avx2", "avx512f", "avx512bw", "avx512_bf16"] + (["amx_bf16", "amx_tile"] if amx else [])
    monkeypatch.setattr(cache, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cd, "cpu_flags", lambda: flags)
    assert gemv_max_rows(torch.bfloat16) == (4 if amx else 16) and gemv_max_rows(torch.float32) == 16
    for dtype, split in ((torch.bfloat16, amx), (torch.float32, False)):
        graphs = cd.CompiledDecode(torch.nn.Linear(4, 4).to(dtype), 32, "[test]")._graphs
        got = [(g.lo, g.hi, g.trace_bs) for g in graphs]
        small = [(2, 4, 4), (5, 16, 8)] if split else [(2, 16, 8)]
        assert got == [(1, 1, 1), *small, (17, 32, 32)], (dtype, got)
