"""The quantized GEMVs (srt/layers/cpu_qgemv.cpp): a GGUF's int4 codes and the int8 LM head.

Checked against torch's own int4 / int8 CPU kernels (the reference path, and what the
server runs where this CPU lacks AVX512-BF16) and against a float64 matmul of the same
dequantized weights, at every row count of a register tile (1-8) and past it (9-16, and a
prefill's 40 rows), on the model's shapes. The packing's layout is checked on any CPU (it
is plain tensor ops); the kernels run only with AVX512-BF16, elsewhere those tests skip.
An AOTInductor package calls the ops like any other (the real model's package is built in
test_aoti_decode.py).
"""
from __future__ import annotations

import pytest
import torch

from srt.layers import cpu_gemv
from srt.layers.cpu_int4_linear import int4_from_codes, int4_linear, int4_supported
from srt.layers.cpu_int8_linear import int8_linear, int8_supported, quantize_int8
from srt.layers.cpu_qgemv import GROUP, pack_int4, pack_int8, quantized_linear

needs_kernel = pytest.mark.skipif(not cpu_gemv.cpu_runs(torch.bfloat16), reason="no AVX512-BF16 on this CPU")
needs_torch_kernels = pytest.mark.skipif(not (int4_supported() and int8_supported()),
                                         reason="this torch has no CPU int4 / int8 kernel")
SHAPES = [(960, 576), (576, 1536), (3072, 576), (48, 64)]


@pytest.fixture(scope="module")
def library():
    from srt.layers.cpu_kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("gramsync's CPU kernels are not built here")


def _int4_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // GROUP, generator=g) * 0.02).to(torch.bfloat16)
    zero = (torch.randn(n, k // GROUP, generator=g) * 0.02).to(torch.bfloat16)
    dense = (codes.double() - 8) * scale.double().repeat_interleave(GROUP, 1) + zero.double().repeat_interleave(GROUP, 1)
    return codes, scale, zero, dense


def _close_to(y: torch.Tensor, ref: torch.Tensor) -> None:
    """One rounding of an fp32 sum to bf16 (2^-8 relative), bounded by the output's scale."""
    err = (y.double() - ref).abs().max().item()
    assert err <= 2 ** -7 * ref.abs().max().item(), err


def test_the_int4_packing_puts_each_code_where_the_kernel_reads_it():
    codes, scale, zero, _ = _int4_weight(32, 64, 0)
    wp = pack_int4(codes, scale, zero).wp
    assert wp.shape == (2, 2, 320) and wp.dtype == torch.uint8
    for panel, group, quad, n, j in [(0, 0, 0, 0, 0), (1, 1, 7, 15, 1), (0, 1, 3, 9, 0), (1, 0, 5, 2, 1)]:
        byte = int(wp[panel, group, quad * 32 + 2 * n + j])
        k = group * GROUP + 4 * quad + j
        assert byte & 15 == int(codes[panel * 16 + n, k]) and byte >> 4 == int(codes[panel * 16 + n, k + 2])
    scales = wp[1, 1, 256:288].contiguous().view(torch.bfloat16)
    zeros = wp[1, 1, 288:320].contiguous().view(torch.bfloat16)
    assert torch.equal(scales, scale[16:32, 1]) and torch.equal(zeros, zero[16:32, 1])


def test_the_int8_packing_is_panels_of_16_outputs_in_input_pairs():
    q = torch.randint(-127, 128, (48, 8), dtype=torch.int8)
    w = pack_int8(q, torch.rand(48, dtype=torch.bfloat16))
    assert w.wp.shape == (3, 4, 16, 2) and torch.equal(w.wp[2, 2, :, 1], q[32:48, 5])
    assert w.scale.dtype == torch.float32


@needs_kernel
@needs_torch_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 40])
def test_int4_matches_torchs_kernel_and_a_float64_matmul(library, rows):
    for i, (n, k) in enumerate(SHAPES):
        codes, scale, zero, dense = _int4_weight(n, k, i)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        ours = quantized_linear(x, pack_int4(codes, scale, zero), None)
        theirs = int4_linear(x, int4_from_codes(codes, scale, zero, GROUP), None)
        assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
        ref = x.double() @ dense.T
        _close_to(ours, ref)
        _close_to(theirs, ref)  # both round the same values' fp32 sums once


@needs_kernel
@needs_torch_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 40])
def test_int8_matches_torchs_kernel_and_a_float64_matmul(library, rows):
    for i, (n, k) in enumerate(SHAPES):
        q = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(i)))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        ours = quantized_linear(x, pack_int8(q.qdata, q.scales), None)
        ref = x.double() @ (q.qdata.double() * q.scales.double()[:, None]).T
        _close_to(ours, ref)
        _close_to(int8_linear(x, q, None), ref)


@needs_kernel
def test_inputs_of_any_shape_and_dtype_come_back_in_it(library):
    codes, scale, zero, dense = _int4_weight(64, 96, 3)
    w4 = pack_int4(codes, scale, zero)
    x3 = torch.randn(2, 3, 96)  # fp32 activations: bf16 inside, the output back in fp32
    y = quantized_linear(x3, w4, torch.ones(64))
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    _close_to(y.reshape(6, 64) - 1, x3.reshape(6, 96).bfloat16().double() @ dense.T)
    wide = torch.randn(5, 192).bfloat16()
    _close_to(quantized_linear(wide[:, ::2], w4, None), wide[:, ::2].double() @ dense.T)  # strided x
    assert quantized_linear(x3[:0], w4, None).shape == (0, 3, 64)


@needs_kernel
def test_the_ops_refuse_what_they_cannot_run_with_a_clear_error(library):
    codes, scale, zero, _ = _int4_weight(32, 64, 4)
    wp = pack_int4(codes, scale, zero).wp
    with pytest.raises(RuntimeError, match="x must be a bf16 CPU tensor"):
        torch.ops.gramsync.int4_linear(torch.randn(1, 64), wp)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        torch.ops.gramsync.int4_linear(torch.randn(1, 32).bfloat16(), wp)
    with pytest.raises(RuntimeError, match="not packed by cpu_qgemv.pack_int4"):
        torch.ops.gramsync.int4_linear(torch.randn(1, 64).bfloat16(), codes)
    w8 = pack_int8(torch.zeros(32, 64, dtype=torch.int8), torch.ones(32))
    with pytest.raises(RuntimeError, match="scale must be fp32"):
        torch.ops.gramsync.int8_linear(torch.randn(1, 64).bfloat16(), w8.wp, torch.ones(31))


class _Int4Then8(torch.nn.Module):
    def __init__(self):
        super().__init__()
        codes, scale, zero, _ = _int4_weight(96, 64, 5)
        self.w4 = pack_int4(codes, scale, zero)
        self.w8 = pack_int8(quantize_int8(torch.randn(48, 96)).qdata, torch.rand(48) * 0.01)

    def forward(self, x):
        return quantized_linear(torch.relu(quantized_linear(x, self.w4, None)), self.w8, None)


@needs_kernel
@pytest.mark.timeout(300)
def test_a_package_calls_the_ops_with_their_packed_weights(library, tmp_path):
    from torch.export import Dim

    module = _Int4Then8().eval()
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        program = torch.export.export(module, (x,), dynamic_shapes=({0: Dim("rows", min=2, max=16)},))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert "gramsync.int4_linear.default" in targets and "gramsync.int8_linear.default" in targets
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "q.pt2"),
                                                        inductor_configs={"freezing": True})
    run = torch._inductor.aoti_load_package(path)
    for rows in (2, 7, 16):
        xs = torch.randn(rows, 64).bfloat16()
        assert torch.equal(run(xs), module(xs))  # the same ops on the same weights
