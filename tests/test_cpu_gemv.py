"""The hand-written small-batch GEMV (srt/layers/cpu_gemv.cpp) and where the graphs use it.

The kernel is built from source with the machine's C++ compiler (as Inductor's code is)
and checked against float64 matmuls at every row count 1-16 (each register-tile shape)
and past it, on the model's weight shapes and odd ones; then the routing: only inside a
trace whose rows are known to be <= 16, only where the CPU runs the dtype natively and
``GRAMSYNC_CPU_GEMV`` is not 0; and a real AOTInductor package (export + compile with
freezing, as the decode graphs are built) calls the op on a weight packed once at compile
time, giving ``F.linear``'s results. The real model's package is checked in
test_aoti_decode.py. fp32 runs on AVX512F+BW or AVX2+FMA CPUs (two kernels), bf16 on
AVX512-BF16 only; elsewhere the tests skip (the graphs keep oneDNN / the template there).
"""
from __future__ import annotations

import glob
import zipfile

import pytest
import torch
from torch.export import Dim

from srt.layers import cpu_gemv
from srt.layers.cpu_kernels import load_cpu_kernels
from srt.layers.cpu_packed_linear import linear

needs_f32 = pytest.mark.skipif(not cpu_gemv.cpu_runs(torch.float32), reason="neither AVX512F/BW nor AVX2+FMA on this CPU")
needs_bf16 = pytest.mark.skipif(not cpu_gemv.cpu_runs(torch.bfloat16), reason="no AVX512-BF16 on this CPU")
DTYPES = [pytest.param(torch.float32, marks=needs_f32), pytest.param(torch.bfloat16, marks=needs_bf16)]


@pytest.fixture(scope="module", autouse=True)
def library():
    if not (cpu_gemv.cpu_runs(torch.float32) and load_cpu_kernels()):
        pytest.skip("the GEMV kernel is not built for this CPU")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = _reference(x, w)
    assert y.dtype == x.dtype and y.shape == ref.shape
    # fp32: accumulation order only. bf16: one rounding of an fp32 sum (2^-8 relative).
    tol = 1e-5 if x.dtype == torch.float32 else 2 ** -7
    err = (y.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), (x.shape, w.shape, err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 40])
def test_kernel_matches_a_float64_matmul(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    for n, k in ((960, 576), (576, 1536), (48, 2), (16, 50), (3072 + 16, 30)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        _check(cpu_gemv.small_linear(x, w), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_batched_and_strided_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g).to(dtype)
    x3 = torch.randn(2, 3, 96, generator=g).to(dtype)
    y = cpu_gemv.small_linear(x3, w)
    assert y.shape == (2, 3, 64)
    _check(y.reshape(6, 64), x3.reshape(6, 96), w)
    wide = torch.randn(5, 192, generator=g).to(dtype)
    _check(cpu_gemv.small_linear(wide[:, ::2], w), wide[:, ::2], w)  # non-contiguous x
    assert cpu_gemv.small_linear(x3[:0], w).shape == (0, 3, 64)


@needs_f32
def test_kernel_refuses_what_it_cannot_run_with_a_clear_error():
    w = torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="must be CPU tensors of one dtype"):
        torch.ops.gramsync.small_linear(torch.randn(1, 8), cpu_gemv.pack_weight(w).double())
    with pytest.raises(RuntimeError, match="not packed by cpu_gemv.pack_weight"):
        torch.ops.gramsync.small_linear(torch.randn(1, 8), w)
    with pytest.raises(RuntimeError, match="x has 7 columns, weight 8"):
        torch.ops.gramsync.small_linear(torch.randn(1, 7), cpu_gemv.pack_weight(w))
    with pytest.raises(RuntimeError, match="no kernel for Half"):
        torch.ops.gramsync.small_linear(torch.randn(1, 8).half(), cpu_gemv.pack_weight(w.half()))


class _TwoLinears(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w1 = torch.nn.Parameter(torch.randn(96, 64, generator=g).to(dtype), requires_grad=False)
        self.b1 = torch.nn.Parameter(torch.randn(96, generator=g).to(dtype), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(40, 96, generator=g).to(dtype), requires_grad=False)  # 40: not panels

    def forward(self, x):
        return linear(torch.relu(linear(x, self.w1, None, self.b1)), self.w2, None)


def _exported_targets(dtype, lo, hi) -> list[str]:
    with torch.no_grad():
        program = torch.export.export(_TwoLinears(dtype).eval(), (torch.randn(max(lo, 2), 64).to(dtype),),
                                      dynamic_shapes=({0: Dim("rows", min=lo, max=hi)},))
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


@needs_f32
def test_only_graphs_of_up_to_16_rows_use_the_kernel(monkeypatch):
    assert not cpu_gemv.use_gemv(torch.randn(1, 64), torch.randn(96, 64))  # eager: never
    small = _exported_targets(torch.float32, 2, 16)
    assert small.count("gramsync.small_linear.default") == 1  # w1 (96 rows); w2's 40 rows stay dense
    assert "aten.linear.default" in small
    assert "gramsync.small_linear.default" not in _exported_targets(torch.float32, 17, 64)
    monkeypatch.setenv("GRAMSYNC_CPU_GEMV", "0")
    assert "gramsync.small_linear.default" not in _exported_targets(torch.float32, 2, 16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_package_calls_the_kernel_on_weights_packed_at_compile_time(dtype, tmp_path):
    module = _TwoLinears(dtype).eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(dtype)
    most = cpu_gemv.gemv_max_rows(dtype)  # 16; 4 for bf16 with AMX (oneDNN's graph above)
    with torch.no_grad():  # as the decode graphs are built: no grad, so freezing applies
        program = torch.export.export(module, (x[:most],), dynamic_shapes=({0: Dim("rows", min=2, max=most)},))
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "two.pt2"),
                                                        inductor_configs={"freezing": True})
    with zipfile.ZipFile(path) as z:
        z.extractall(tmp_path / "unzipped")
    wrapper = open(glob.glob(str(tmp_path / "unzipped" / "**" / "*.wrapper.cpp"), recursive=True)[0]).read()
    assert "proxy_executor_call_function" in wrapper  # the op, through AOTInductor's proxy executor
    assert "permute" not in wrapper  # the panel packing was folded at compile time, not run per call
    run = torch._inductor.aoti_load_package(path)
    for rows in sorted({2, min(5, most), most}):
        xs = torch.randn(rows, 64, generator=g).to(dtype)
        want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(xs, module.w1, module.b1)), module.w2)
        got = run(xs)
        # bf16: the hidden layer is rounded to bf16 after two different accumulation orders, so
        # one element may differ by an ulp of the hidden value times w2; bound it by the output scale.
        scale = want.abs().max().item()
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.03 * scale)
        torch.testing.assert_close(got, want, **tol)
