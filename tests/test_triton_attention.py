"""srt.layers.attention.triton_ops: decode_attention and extend_attention against a plain
torch reference (keys gathered through req_to_token, fp32 softmax, causal mask for
extend), on pools whose slots are shuffled, with GQA, head_dim 64/128 and 48 (padded
BLOCK_D), token-major pool views and strided q/out. The kernels run under
TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton decorates
them; tiny shapes, the interpreter is slow), and on CUDA when there is a GPU."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN_DIR = os.path.join(ROOT, "srt", "layers", "attention")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def load_triton_ops():
    """The module, by its package when srt/layers/attention is one, else by file path."""
    if os.path.exists(os.path.join(ATTN_DIR, "__init__.py")):
        return importlib.import_module("srt.layers.attention.triton_ops")
    spec = importlib.util.spec_from_file_location("gramsync_triton_ops", os.path.join(ATTN_DIR, "triton_ops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- inputs and reference ---------------------------------------------------------------
def make_pool(kvh, pool_size, d, dtype, gen, device, token_major=False):
    """k/v as [KVH, pool_size + 1, D]; token_major: a transposed [pool+1, KVH, D] buffer."""
    shape = (pool_size + 1, kvh, d) if token_major else (kvh, pool_size + 1, d)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    return (k.transpose(0, 1), v.transpose(0, 1)) if token_major else (k, v)


def make_table(lens, pool_size, gen, device, dtype=torch.int64):
    """req_to_token with each sequence's slots drawn from a shuffled pool (never slot 0) in
    shuffled, non-leading rows; returns (req_to_token, req_pool_indices)."""
    max_reqs, max_context = len(lens) + 3, max(lens) + 5
    table = torch.zeros(max_reqs, max_context, dtype=dtype)
    rows = torch.randperm(max_reqs, generator=gen)[:len(lens)]
    free = torch.randperm(pool_size, generator=gen) + 1
    assert sum(lens) <= pool_size
    for row, n in zip(rows.tolist(), lens):
        table[row, :n], free = free[:n], free[n:]
    return table.to(device), rows.to(device)


def reference(q, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale):
    """Per sequence: gather its keys, GQA by repeating kv heads, causal softmax in fp32."""
    h, kvh = q.shape[1], k_buf.shape[0]
    outs, start = [], 0
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        slots = table[row, :p + e]
        k = k_buf[:, slots].float().repeat_interleave(h // kvh, 0)  # [H, L, D]
        v = v_buf[:, slots].float().repeat_interleave(h // kvh, 0)
        qi = q[start:start + e].float().transpose(0, 1)  # [H, e, D]
        s = qi @ k.transpose(1, 2) * scale
        visible = torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
        start += e
    return torch.cat(outs).to(q.dtype)


def assert_close(got, want, dtype):
    tol = TOL[dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), f"max abs err {err}"


# -- cases: (H, KVH, D, dtype, lens..., options) -------------------------------------------
DECODE_CASES = [
    # lengths 1, not a multiple of BLOCK_N (64), > one block; 3 splits leave some empty
    dict(h=6, kvh=2, d=64, dtype=torch.float32, lens=[1, 37, 150], splits=3),
    dict(h=6, kvh=2, d=64, dtype=torch.float32, lens=[70, 1], splits=1),
    dict(h=2, kvh=2, d=48, dtype=torch.float32, lens=[5, 66], token_major=True, strided=True),
    dict(h=6, kvh=2, d=64, dtype=torch.bfloat16, lens=[1, 37, 90], splits=2),
    dict(h=4, kvh=1, d=128, dtype=torch.float16, lens=[33, 3], splits=2, index_dtype=torch.int32),
    dict(h=2, kvh=1, d=128, dtype=torch.float32, lens=[40], splits=2),  # fp32 x 128: BLOCK_N 32
    dict(h=40, kvh=1, d=16, dtype=torch.float32, lens=[9, 20], splits=1),  # 40-head group: 2 blocks
]
EXTEND_CASES = [
    # no prefix, prefix, extend > BLOCK_M (several causal query blocks), extend 1
    dict(h=6, kvh=2, d=64, dtype=torch.float32, prefix=[0, 5, 0, 7], extend=[1, 30, 70, 3]),
    dict(h=2, kvh=2, d=48, dtype=torch.float32, prefix=[3, 0], extend=[4, 9], token_major=True,
         strided=True),
    dict(h=6, kvh=2, d=64, dtype=torch.bfloat16, prefix=[0, 66], extend=[20, 5]),
    dict(h=2, kvh=1, d=128, dtype=torch.float32, prefix=[3], extend=[40]),  # BLOCK_M = BLOCK_N = 32
    dict(h=4, kvh=4, d=128, dtype=torch.float16, prefix=[0], extend=[17], index_dtype=torch.int32),
]


def _q_and_out(t, h, d, dtype, gen, device, strided):
    """q (as a slice of a fused qkv when strided) and the out tensor to pass (or None)."""
    if not strided:
        return torch.randn(t, h, d, generator=gen).to(dtype).to(device), None
    qkv = torch.randn(t, 3 * h * d, generator=gen).to(dtype).to(device)
    out = torch.full((t, h, d + 8), float("nan"), dtype=dtype, device=device)[:, :, 4:d + 4]
    return qkv[:, :h * d].view(t, h, d), out


def check_decode(mod, device, case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d, dtype, lens = case["h"], case["kvh"], case["d"], case["dtype"], case["lens"]
    pool_size = sum(lens) + 7
    k_buf, v_buf = make_pool(kvh, pool_size, d, dtype, gen, device, case.get("token_major", False))
    idx = case.get("index_dtype", torch.int64)  # req_to_token, req_pool_indices, seq_lens
    table, rows = make_table(lens, pool_size, gen, device, idx)
    q, out = _q_and_out(len(lens), h, d, dtype, gen, device, case.get("strided", False))
    seq_lens = torch.tensor(lens, dtype=idx, device=device)
    rows = rows.to(idx)
    scale = d ** -0.5
    got = mod.decode_attention(q, k_buf, v_buf, table, rows, seq_lens, scale, out=out,
                               num_kv_splits=case.get("splits"))
    assert got.shape == q.shape and got.dtype == dtype and (out is None or got is out)
    want = reference(q, k_buf, v_buf, table, rows, [n - 1 for n in lens], [1] * len(lens), scale)
    assert_close(got, want, dtype)


def check_extend(mod, device, case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d, dtype = case["h"], case["kvh"], case["d"], case["dtype"]
    prefix, extend = case["prefix"], case["extend"]
    lens = [p + e for p, e in zip(prefix, extend)]
    pool_size = sum(lens) + 7
    k_buf, v_buf = make_pool(kvh, pool_size, d, dtype, gen, device, case.get("token_major", False))
    idx = case.get("index_dtype", torch.int64)
    table, rows = make_table(lens, pool_size, gen, device, idx)
    q, out = _q_and_out(sum(extend), h, d, dtype, gen, device, case.get("strided", False))
    as_t = lambda x: torch.tensor(x, dtype=idx, device=device)  # noqa: E731
    rows = rows.to(idx)
    scale = d ** -0.5
    got = mod.extend_attention(q, k_buf, v_buf, table, rows, as_t(prefix), as_t(extend), scale, out=out)
    assert got.shape == q.shape and got.dtype == dtype and (out is None or got is out)
    assert_close(got, reference(q, k_buf, v_buf, table, rows, prefix, extend, scale), dtype)
    # max_extend_len from the caller (no host sync) gives the same result
    again = mod.extend_attention(q, k_buf, v_buf, table, rows, as_t(prefix), as_t(extend), scale,
                                 max_extend_len=max(extend))
    assert torch.equal(again, got)


# -- interpreted (CPU) ------------------------------------------------------------------
INTERPRET_SCRIPT = textwrap.dedent("""
    import sys, time
    from tests import test_triton_attention as t
    mod = t.load_triton_ops()
    assert mod._INTERPRETED, "TRITON_INTERPRET=1 did not take effect"
    check, cases = {"decode": (t.check_decode, t.DECODE_CASES),
                    "extend": (t.check_extend, t.EXTEND_CASES)}[sys.argv[1]]
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        check(mod, "cpu", case, seed=i)
        print(f"case {i} ok in {time.perf_counter() - t0:.2f}s", flush=True)
    print("TRITON-INTERPRET-OK")
""")


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_kernels_interpreted(kind):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT, kind], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "TRITON-INTERPRET-OK" in proc.stdout, proc.stdout + proc.stderr


# -- argument checks (in process: they fire before any launch) ------------------------------
def test_argument_errors_and_empty_batches():
    mod = load_triton_ops()
    gen = torch.Generator().manual_seed(9)
    k, v = make_pool(2, 20, 64, torch.float32, gen, "cpu")
    table, rows = make_table([3, 4], 20, gen, "cpu")
    q, lens = torch.randn(2, 6, 64), torch.tensor([3, 4])
    dec = lambda **kw: mod.decode_attention(**{**dict(q=q, k_buffer=k, v_buffer=v, req_to_token=table,  # noqa: E731
        req_pool_indices=rows, seq_lens=lens, scale=0.125), **kw})
    ext = lambda **kw: mod.extend_attention(**{**dict(q=q, k_buffer=k, v_buffer=v, req_to_token=table,  # noqa: E731
        req_pool_indices=rows, prefix_lens=torch.tensor([0, 0]), extend_lens=lens - 2, scale=0.125), **kw})
    for call in (dec, ext):
        with pytest.raises(ValueError, match="num_heads=5 is not a multiple of num_kv_heads=2"):
            call(q=torch.randn(2, 5, 64))
        with pytest.raises(ValueError, match="head_dim mismatch: q has 32"):
            call(q=torch.randn(2, 6, 32))
        with pytest.raises(ValueError, match="q must be 3-D"):
            call(q=torch.randn(2, 6 * 64))
        with pytest.raises(ValueError, match="dtype mismatch"):
            call(q=q.bfloat16())
        with pytest.raises(ValueError, match="dtype mismatch"):
            call(v_buffer=v.half())
        with pytest.raises(ValueError, match="k_buffer and v_buffer"):
            call(v_buffer=v[:, :10])
        with pytest.raises(ValueError, match="req_to_token must be a 2-D"):
            call(req_to_token=table.float())
        # decode: B comes from q; extend: from req_pool_indices, so prefix_lens is off
        with pytest.raises(ValueError, match="(req_pool_indices|prefix_lens) must be a 1-D .* of length [12],"):
            call(req_pool_indices=rows[:1])
        with pytest.raises(ValueError, match="out must match q"):
            call(out=torch.empty(2, 6, 64, dtype=torch.float16))
        with pytest.raises(ValueError, match="one device"):
            call(k_buffer=k.to("meta"), v_buffer=v.to("meta"))
    with pytest.raises(ValueError, match="seq_lens must be a 1-D"):
        dec(seq_lens=torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1"):
        dec(num_kv_splits=0)
    with pytest.raises(ValueError, match="extend_lens must be a 1-D"):
        ext(extend_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="extend_lens sum to 3 but q has 2 tokens"):
        ext(extend_lens=torch.tensor([1, 2]))
    if not mod._INTERPRETED:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            dec()
    # Empty batches return before any launch.
    empty = torch.empty(0, dtype=torch.int64)
    assert dec(q=q[:0], req_pool_indices=rows[:0], seq_lens=empty).shape == (0, 6, 64)
    assert ext(q=q[:0], req_pool_indices=rows[:0], prefix_lens=empty, extend_lens=empty).shape == (0, 6, 64)


# -- CUDA -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_cuda():
    mod = load_triton_ops()
    for i, case in enumerate(DECODE_CASES):
        check_decode(mod, "cuda", case, seed=i)
        check_decode(mod, "cuda", {**case, "splits": None}, seed=i)  # the SM-count default
    for i, case in enumerate(EXTEND_CASES):
        check_extend(mod, "cuda", case, seed=i)
    # Serving-sized shapes: long contexts, many splits, several query blocks per sequence.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_decode(mod, "cuda", dict(h=32, kvh=8, d=128, dtype=dtype, lens=[1, 700, 4099, 33]), seed=7)
        check_extend(mod, "cuda", dict(h=32, kvh=8, d=128, dtype=dtype, prefix=[0, 1000, 17],
                                       extend=[513, 300, 1]), seed=8)
