"""srt.layers.moe.fused_moe_triton against a per-slot torch loop: repeated experts within a
token, experts that get no tokens, skewed routing (several tiles for one expert), expert
parallelism (expert_offset, ids of other ranks), strided x, T=0, fp32/bf16/fp16. The
kernels run under TRITON_INTERPRET=1 in a subprocess (the variable must be set before
triton decorates them; tiny shapes, the interpreter is slow), and on CUDA when there is a GPU."""
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
MOE_DIR = os.path.join(ROOT, "srt", "layers", "moe")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative to max |ref|


def load_fused_moe():
    """The module, by its package when srt/layers/moe is one, else by file path."""
    if os.path.exists(os.path.join(MOE_DIR, "__init__.py")):
        return importlib.import_module("srt.layers.moe.fused_moe_triton")
    spec = importlib.util.spec_from_file_location("gramsync_fused_moe_triton",
                                                  os.path.join(MOE_DIR, "fused_moe_triton.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference(x, w13, w2, topk_weights, topk_ids, expert_offset=0):
    """The definition, one (token, slot) at a time, in fp32."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t, row in enumerate(topk_ids.tolist()):  # one copy to the host, not a sync per slot
        for j, expert in enumerate(row):
            e = expert - expert_offset
            if 0 <= e < num_experts:
                h = xf[t] @ w13f[e].T
                a = torch.nn.functional.silu(h[:inter]) * h[inter:]
                out[t] += topk_weights[t, j].float() * (a @ w2f[e].T)
    return out


# -- cases ------------------------------------------------------------------------------
# routing: "random" distinct experts per token, "repeat" some tokens pick one expert twice,
# "skewed" most slots on expert 3 and only experts {1, 3, 6} used (the rest get nothing).
# total > E: ids span [0, total) and this rank holds [offset, offset + E).
CASES = [
    dict(t=1, dtype=torch.float32, routing="random"),
    dict(t=5, dtype=torch.float32, routing="repeat", index_dtype=torch.int32),
    dict(t=33, dtype=torch.float32, routing="skewed", strided=True),
    dict(t=33, dtype=torch.float32, routing="random", total=24, offset=8),
    dict(t=5, dtype=torch.float32, routing="random", total=16, offset=8),
    dict(t=130, dtype=torch.float32, routing="random"),  # > 32 slots per expert: BLOCK_M 64
    dict(t=33, dtype=torch.bfloat16, routing="repeat", total=16, offset=0),
    dict(t=5, dtype=torch.float16, routing="skewed"),
    dict(t=0, dtype=torch.float32, routing="random"),
]


def make_inputs(case, gen, device, h=64, inter=32, e=8, k=2):
    t, dtype, total = case["t"], case["dtype"], case.get("total", e)
    if case.get("strided"):  # x as a column slice of a wider buffer
        x = torch.randn(t, h + 16, generator=gen)[:, 8:8 + h]
    else:
        x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter ** -0.5
    ids = torch.stack([torch.randperm(total, generator=gen)[:k] for _ in range(t)]) if t else \
        torch.empty(0, k, dtype=torch.int64)
    if case["routing"] == "repeat":
        ids[::2, 1] = ids[::2, 0]
    elif case["routing"] == "skewed":
        ids = torch.tensor([1, 6], dtype=torch.int64)[torch.randint(0, 2, (t, k), generator=gen)]
        ids[torch.rand(t, k, generator=gen) < 0.7] = 3
    weights = torch.rand(t, k, generator=gen).softmax(-1)
    ids = ids.to(case.get("index_dtype", torch.int64))
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
            weights.to(device), ids.to(device))


def check_case(mod, device, case, seed=0, **shape):
    gen = torch.Generator().manual_seed(seed)
    x, w13, w2, weights, ids = make_inputs(case, gen, device, **shape)
    offset = case.get("offset", 0)
    got = mod.fused_moe_triton(x, w13, w2, weights, ids, expert_offset=offset)
    assert got.shape == x.shape and got.dtype == x.dtype and got.device == x.device
    want = reference(x, w13, w2, weights, ids, offset)
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got.float() - want).abs().max().item() if want.numel() else 0.0
    assert err <= TOL[case["dtype"]] * scale, f"max abs err {err} (max |ref| {scale}) in {case}"
    if offset or case.get("total", 8) > 8:  # tokens with no local expert come out exactly 0
        local = ((ids.long() - offset >= 0) & (ids.long() - offset < w13.shape[0])).any(1)
        assert (got[~local] == 0).all()


# -- interpreted (CPU) ------------------------------------------------------------------
INTERPRET_SCRIPT = textwrap.dedent("""
    import time
    from tests import test_fused_moe_triton as t
    mod = t.load_fused_moe()
    assert mod._INTERPRETED, "TRITON_INTERPRET=1 did not take effect"
    for i, case in enumerate(t.CASES):
        t0 = time.perf_counter()
        t.check_case(mod, "cpu", case, seed=i)
        print(f"case {i} ok in {time.perf_counter() - t0:.2f}s", flush=True)
    print("TRITON-INTERPRET-OK")
""")


def test_kernels_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    # subprocess.run kills the child when the timeout (or any exception) ends the wait.
    proc = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "TRITON-INTERPRET-OK" in proc.stdout, proc.stdout + proc.stderr


def test_align_groups_slots_by_expert():
    """Each tile holds one expert's slots (or padding); every local slot appears once."""
    mod = load_fused_moe()
    ids = torch.tensor([[3, 3], [0, 9], [3, 5], [12, 11]])  # E=4 at offset 2: experts 2..5
    slots, block_expert = mod.moe_align(ids, 4, 2, 16)
    assert block_expert.tolist()[:2] == [1, 3] and (block_expert[2:] == 4).all()  # 2, 3: empty
    assert slots[:16].tolist() == [0, 1, 4] + [8] * 13 and slots[16:32].tolist() == [5] + [8] * 15
    assert (slots[32:] == 8).all()


def test_argument_errors_and_no_device():
    mod = load_fused_moe()
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = make_inputs(dict(t=3, dtype=torch.float32, routing="random"), gen, "cpu")
    call = lambda **kw: mod.fused_moe_triton(**{**dict(x=x, w13=w13, w2=w2, topk_weights=weights,  # noqa: E731
                                                       topk_ids=ids), **kw})
    with pytest.raises(ValueError, match="shape mismatch"):
        call(w2=w2[:, :, :16])
    with pytest.raises(ValueError, match="shape mismatch"):
        call(w13=w13[:, :63])
    with pytest.raises(ValueError, match="need x"):
        call(x=x[0])
    with pytest.raises(ValueError, match="must both be"):
        call(topk_weights=weights[:, :1])
    with pytest.raises(ValueError, match="dtype mismatch"):
        call(w2=w2.bfloat16())
    with pytest.raises(ValueError, match="int32/int64"):
        call(topk_ids=ids.float())
    with pytest.raises(ValueError, match="one device"):
        call(w13=w13.to("meta"), w2=w2.to("meta"))
    assert call(x=x[:0], topk_weights=weights[:0], topk_ids=ids[:0]).shape == (0, 64)  # no launch
    if mod._INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set in this process: CPU tensors are allowed")
    with pytest.raises(ValueError, match="need a CUDA device, or TRITON_INTERPRET=1"):
        call()


# -- CUDA -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_cuda():
    mod = load_fused_moe()
    for i, case in enumerate(CASES):
        check_case(mod, "cuda", case, seed=i)
    # Serving-like shapes: H and I not multiples of the tiles, 64 experts over 4 ranks, k=4.
    shape = dict(h=1000, inter=360, e=16, k=4)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for t in (1, 7, 300, 1100):  # 1100*4 slots > 32 per expert: the BLOCK_M 64 path
            check_case(mod, "cuda", dict(t=t, dtype=dtype, routing="random", total=64, offset=16),
                       seed=t, **shape)
        check_case(mod, "cuda", dict(t=500, dtype=dtype, routing="skewed"), seed=1, **shape)
