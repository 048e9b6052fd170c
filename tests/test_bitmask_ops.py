"""constrained.bitmask_ops: the CPU paths (gramsync's C++ op, and the torch ops used before
the kernel library is loaded: each CPU test runs on both) and the Triton kernel against the
masked_fill reference, bit for bit (NaN payloads, +-inf and -0.0 included), the argument
checks, and equality with xgrammar's CPU kernel. The Triton kernel runs under TRITON_INTERPRET=1 in a
subprocess (the variable must be set before triton decorates the kernel), and on CUDA when
there is a GPU."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from constrained import bitmask_ops
from constrained.bitmask_ops import (allocate_token_bitmask, apply_token_bitmask_inplace,
                                     reset_token_bitmask, unpack_bitmask)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(params=["torch", "native"])
def cpu_path(request, monkeypatch):
    """Each CPU test on both paths: the torch ops, and the C++ op (constrained/bitmask_cpu.cpp)."""
    if request.param == "torch":
        monkeypatch.setattr(bitmask_ops, "_native_op", lambda: None)
    else:
        from srt.layers.cpu_kernels import load_cpu_kernels

        if not load_cpu_kernels():
            pytest.skip("gramsync's CPU kernels are not built here")
        assert bitmask_ops._native_op() is not None
    return request.param


def reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    allowed = unpack_bitmask(bitmask.reshape(-1, bitmask.shape[-1]), v).view(logits.shape)
    return logits.masked_fill(~allowed, float("-inf"))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.view(INT_VIEW[got.dtype]), want.view(INT_VIEW[want.dtype]))


def random_logits(b: int, v: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """randn with NaN (odd payload too), +-inf and -0.0 sprinkled in."""
    x = torch.randn(b, v, generator=gen).to(dtype)
    x[:, 1::97] = float("nan")
    x[:, 2::89] = float("inf")
    x[:, 3::83] = float("-inf")
    x[:, 4::79] = -0.0
    nan_payload = 0x7FC01234 if dtype == torch.float32 else 0x7FC3  # canonicalising ops lose it
    x.view(INT_VIEW[dtype])[:, 5::73] = nan_payload
    return x


def random_mask(b: int, words: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**31, 2**31, (b, words), dtype=torch.int32, generator=gen)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,v,extra_words", [
    (1, 100, 0), (3, 1000, 0), (5, 4097, 2), (40, 1000, 0), (8, 32768, 3), (2, 70001, 0),
    (2, 248320, 0),
])
def test_cpu_matches_reference_on_random_masks(b, v, extra_words, dtype):
    gen = torch.Generator().manual_seed(b * 1000 + v)
    logits = random_logits(b, v, dtype, gen)
    mask = random_mask(b, (v + 31) // 32 + extra_words, gen)  # extra words: bits ignored
    want = reference(logits, mask)
    apply_token_bitmask_inplace(logits, mask)
    assert_same_bits(logits, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [49152, 70001, 5003, 40])
def test_cpu_mixed_rows(v, dtype, monkeypatch, cpu_path):
    """Unconstrained, all-disallowed, few-allowed, few-disallowed (the element-wise path,
    with the partial last word) and random rows in one batch."""
    sparse_calls = []
    real_sparse = bitmask_ops._apply_sparse
    monkeypatch.setattr(bitmask_ops, "_apply_sparse",
                        lambda *a: sparse_calls.append(a[2].shape[0]) or real_sparse(*a))
    gen = torch.Generator().manual_seed(v)
    words = (v + 31) // 32
    mask = allocate_token_bitmask(12, v)
    mask[1] = 0
    for row, n in ((2, 3), (3, 1), (4, 40), (5, 2)):
        mask[row, torch.randint(0, words, (n,), generator=gen)] = random_mask(1, n, gen)
    mask[6, -1] = 0  # only the last (partial) word
    mask[7] = random_mask(1, words, gen)
    allowed = torch.zeros(v, dtype=torch.bool)
    allowed[torch.randint(0, v, (5,), generator=gen)] = True
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)
    padded = torch.cat([allowed, torch.zeros(words * 32 - v, dtype=torch.bool)])
    mask[8] = (padded.view(words, 32).long() * weights).sum(1).to(torch.int32)
    logits = random_logits(12, v, dtype, gen)
    want, before = reference(logits, mask), logits.clone()
    apply_token_bitmask_inplace(logits, mask)
    assert_same_bits(logits, want)
    assert torch.isneginf(logits[1]).all()
    assert_same_bits(logits[0], before[0])
    # Row blocks with few disallowed words go to xgrammar's C loop (fp32) or the sparse
    # path; short rows share a block (5003: 6 rows a block, mostly allowed; 40: one block
    # holding the all-disallowed row, so tiles). The C++ op takes every row itself.
    assert bool(sparse_calls) == (cpu_path == "torch" and v > 1000 and dtype != torch.float32)


@pytest.mark.usefixtures("cpu_path")
def test_cpu_many_sparse_elements():
    """More partial words than one element-wise chunk holds: they are regrouped (bf16:
    fp32 rows like these go to xgrammar's C loop instead, checked as well)."""
    gen = torch.Generator().manual_seed(6)
    b, v = 16, 248320
    mask = allocate_token_bitmask(b, v)
    for row in range(b):
        cols = torch.randperm(v // 32, generator=gen)[:900]  # just under 1/8 of the words
        mask[row, cols] = random_mask(1, 900, gen)
    for dtype in (torch.bfloat16, torch.float32):
        logits = random_logits(b, v, dtype, gen)
        want = reference(logits, mask)
        apply_token_bitmask_inplace(logits, mask)
        assert_same_bits(logits, want)


@pytest.mark.usefixtures("cpu_path")
def test_cpu_views_1d_and_strided():
    gen = torch.Generator().manual_seed(1)
    v = 3000
    for mask in (random_mask(1, 94, gen)[0], random_mask(1, 94, gen)):  # [W] and [1, W]
        x = random_logits(1, v, torch.float32, gen)[0]
        want = reference(x.unsqueeze(0), mask.reshape(1, -1))[0]
        apply_token_bitmask_inplace(x, mask)
        assert_same_bits(x, want)
    # Rows of a wider tensor (not contiguous) and a column slice of a wider mask.
    big = random_logits(4, v + 50, torch.bfloat16, gen)
    wide_mask = random_mask(4, 120, gen)
    x, mask = big[:, 10:10 + v], wide_mask[:, :94]
    want = reference(x, mask)
    untouched = big[:, :10].clone()
    apply_token_bitmask_inplace(x, mask)
    assert_same_bits(x, want)
    assert_same_bits(big[:, :10], untouched)
    # A transposed (column-major) mask.
    x, mask = random_logits(3, 640, torch.float16, gen), random_mask(20, 3, gen).t()
    want = reference(x, mask)
    apply_token_bitmask_inplace(x, mask)
    assert_same_bits(x, want)
    # Nearly unconstrained rows of a non-contiguous tensor still take the tiled path.
    x, mask = big[:, :v], allocate_token_bitmask(4, v)
    mask[:, 3] = 0x0F0F0F0F
    want = reference(x, mask)
    apply_token_bitmask_inplace(x, mask)
    assert_same_bits(x, want)


def test_allocate_reset_and_edges():
    mask = allocate_token_bitmask(2, 70)
    assert mask.shape == (2, 3) and mask.dtype == torch.int32 and (mask == -1).all()
    mask[:, 0] = 0
    logits = torch.zeros(2, 70)
    apply_token_bitmask_inplace(logits, mask)
    assert torch.isneginf(logits[:, :32]).all() and (logits[:, 32:] == 0).all()
    reset_token_bitmask(mask)
    assert (mask == -1).all()
    apply_token_bitmask_inplace(torch.zeros(0, 70), torch.zeros(0, 3, dtype=torch.int32))


def test_argument_errors(monkeypatch):
    with pytest.raises(ValueError, match="bitmask covers 64 tokens but logits have 65"):
        apply_token_bitmask_inplace(torch.zeros(1, 65), allocate_token_bitmask(1, 64))
    with pytest.raises(ValueError, match="batch size mismatch"):
        apply_token_bitmask_inplace(torch.zeros(2, 64), allocate_token_bitmask(3, 64))
    with pytest.raises(ValueError, match="batch size mismatch"):
        apply_token_bitmask_inplace(torch.zeros(64), allocate_token_bitmask(2, 64))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_inplace(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        apply_token_bitmask_inplace(torch.zeros(1, 64, dtype=torch.float64),
                                    allocate_token_bitmask(1, 64))
    with pytest.raises(ValueError, match="bitmask on meta"):
        apply_token_bitmask_inplace(torch.zeros(1, 64), allocate_token_bitmask(1, 64, "meta"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        apply_token_bitmask_inplace(torch.zeros(1, 64), allocate_token_bitmask(1, 64),
                                    force_triton=True)


def test_threads_use_their_own_workspaces():
    gen = torch.Generator().manual_seed(2)
    jobs = [(random_logits(b, v, torch.float32, gen), random_mask(b, (v + 31) // 32, gen))
            for b, v in [(3, 50000), (16, 2000), (1, 100000), (5, 33000)] * 2]
    wants = [reference(x, m) for x, m in jobs]
    threads = [threading.Thread(target=apply_token_bitmask_inplace, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (x, _), want in zip(jobs, wants):
        assert_same_bits(x, want)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_matches_xgrammar(dtype):
    xgrammar = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(3)
    for b, v in [(4, 49152), (2, 10007)]:
        logits = random_logits(b, v, dtype, gen).nan_to_num(posinf=5.0)  # finite for xgrammar
        mask = random_mask(b, (v + 31) // 32, gen)
        mask[0] = -1
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, mask)
        apply_token_bitmask_inplace(logits, mask)
        assert_same_bits(logits, want)


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from constrained.bitmask_ops import apply_token_bitmask_inplace
    from tests.test_bitmask_ops import random_logits, random_mask, reference, assert_same_bits
    gen = torch.Generator().manual_seed(4)
    cases = [(3, 5000, 2, torch.float32), (1, 33, 0, torch.bfloat16), (2, 8192, 0, torch.float16),
             (2, 10001, 1, torch.float32)]
    for b, v, extra, dtype in cases:
        logits = random_logits(b, v, dtype, gen)
        mask = random_mask(b, (v + 31) // 32 + extra, gen)
        mask[0, :3] = -1
        want = reference(logits, mask)
        apply_token_bitmask_inplace(logits, mask, force_triton=True)
        assert_same_bits(logits, want)
    big = random_logits(2, 5100, torch.float32, gen)  # strided rows, 1-D
    x, mask = big[:, 50:5050], random_mask(2, 157, gen)
    want = reference(x, mask)
    apply_token_bitmask_inplace(x, mask, force_triton=True)
    assert_same_bits(x, want)
    x, mask = random_logits(1, 700, torch.float32, gen)[0], random_mask(1, 22, gen)[0]
    want = reference(x.unsqueeze(0), mask.unsqueeze(0))[0]
    apply_token_bitmask_inplace(x, mask, force_triton=True)
    assert_same_bits(x, want)
    print("TRITON-INTERPRET-OK")
""")


def test_triton_kernel_interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "TRITON-INTERPRET-OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_cuda(dtype):
    gen = torch.Generator().manual_seed(5)
    for b, v, extra in [(1, 49152, 0), (8, 248320, 0), (3, 10001, 2), (64, 32000, 0)]:
        logits = random_logits(b, v, dtype, gen)
        mask = random_mask(b, (v + 31) // 32 + extra, gen)
        want = reference(logits, mask)
        x = logits.cuda()
        apply_token_bitmask_inplace(x, mask.cuda())
        assert_same_bits(x.cpu(), want)
    x = random_logits(4, 5000, dtype, gen).cuda()[:, 100:4100]  # strided rows
    mask = random_mask(4, 125, gen)
    want = reference(x.cpu(), mask)
    apply_token_bitmask_inplace(x, mask.cuda())
    assert_same_bits(x.cpu(), want)


def test_workspaces_made_under_inference_mode_work_outside_it():
    logits, mask = torch.randn(4, 40000), torch.randint(-2**31, 2**31, (4, 1250), dtype=torch.int32)
    expected = logits.masked_fill(~unpack_bitmask(mask, 40000), float("-inf"))
    with torch.inference_mode():
        inside = logits.clone()
        apply_token_bitmask_inplace(inside, mask)
    outside = logits.clone()
    apply_token_bitmask_inplace(outside, mask)
    assert torch.equal(inside, expected) and torch.equal(outside, expected)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [1000, 49152, 70001])
def test_cpu_few_allowed_rows_with_bits_past_the_vocabulary(v, dtype):
    """Rows allowing a handful of tokens take the save / fill / restore path; set bits past
    V (padding of the last word, extra words) must not touch anything; more rows than one
    piece holds (70001 -> 2188 words: 14 rows a piece)."""
    gen = torch.Generator().manual_seed(v)
    words = (v + 31) // 32 + 1
    mask = torch.zeros(40, words, dtype=torch.int32)
    for row in range(40):
        mask[row, torch.randint(0, words, (3,), generator=gen)] = random_mask(1, 3, gen)
    mask[:, -1] = -1  # every bit past the vocabulary set
    mask[5] = -1  # an unconstrained row among them
    logits = random_logits(40, v, dtype, gen)
    want = reference(logits, mask)
    apply_token_bitmask_inplace(logits, mask)
    assert_same_bits(logits, want)
