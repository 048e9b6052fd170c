"""The GPU timings of ``make gpu-check`` (gpu_check.py): each kernel beside its reference in
the same run, with the outputs compared. Every function returns rows of
(name, status, detail); a function that cannot run here says why in a SKIP row."""
from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def environment_line() -> str:
    parts = [f"torch {torch.__version__}", f"cuda {torch.version.cuda}"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        parts.append(f"{len(names)} GPU(s): {', '.join(names)}")
    else:
        parts.append("no CUDA device")
    for mod in ("triton", "flashinfer"):
        spec = importlib.util.find_spec(mod)
        parts.append(f"{mod} {__import__(mod).__version__ if spec else 'not installed'}")
    return "gpu-check environment: " + "; ".join(parts)


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def bitmask_rows() -> list[tuple[str, str, str]]:
    from constrained.bitmask_ops import apply_token_bitmask_inplace, unpack_bitmask

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        b, v = 64, 248320
        logits = torch.randn(b, v, device="cuda").to(dtype)
        mask = torch.randint(-2**31, 2**31, (b, (v + 31) // 32), dtype=torch.int32, device="cuda")
        want = logits.masked_fill(~unpack_bitmask(mask, v), float("-inf"))
        got = logits.clone()
        apply_token_bitmask_inplace(got, mask)
        same = torch.equal(got, want)
        ours = _median_ms(lambda: apply_token_bitmask_inplace(logits.clone(), mask))
        ref = _median_ms(lambda: logits.clone().masked_fill_(~unpack_bitmask(mask, v), float("-inf")))
        rows.append((f"bench bitmask [{b},{v}] {str(dtype)[6:]}", "PASS" if same else "FAIL",
                     f"triton {ours:.3f} ms, torch unpack+masked_fill {ref:.3f} ms, ratio {ref / ours:.2f}x"
                     + ("" if same else "; OUTPUTS DIFFER")))
    return rows


def decode_attention_rows() -> list[tuple[str, str, str]]:
    """Decode attention over a paged pool at serving lengths (GQA 32/8 heads, d=128)."""
    from srt.layers.attention.triton_ops import decode_attention

    gen = torch.Generator().manual_seed(0)
    h, kvh, d, dtype = 32, 8, 128, torch.bfloat16
    lens = [int(x) for x in torch.randint(200, 4096, (32,), generator=gen)]
    pool = sum(lens) + 1
    k = torch.randn(kvh, pool, d, generator=gen).to(dtype).cuda()
    v = torch.randn(kvh, pool, d, generator=gen).to(dtype).cuda()
    slots = (torch.randperm(pool - 1, generator=gen) + 1).cuda()
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64, device="cuda")
    start = 0
    for i, n in enumerate(lens):
        table[i, :n], start = slots[start:start + n], start + n
    rows = torch.arange(len(lens), device="cuda")
    seq = torch.tensor(lens, device="cuda")
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype).cuda()

    def reference():
        outs = []
        for i, n in enumerate(lens):
            idx = table[i, :n]
            kk = k[:, idx].repeat_interleave(h // kvh, 0).float()
            vv = v[:, idx].repeat_interleave(h // kvh, 0).float()
            p = torch.softmax((q[i].float().unsqueeze(1) @ kk.transpose(1, 2)) * d ** -0.5, -1)
            outs.append((p @ vv).squeeze(1))
        return torch.stack(outs).to(dtype)

    got = decode_attention(q, k, v, table, rows, seq, d ** -0.5)
    err = (got.float() - reference().float()).abs().max().item()
    ours = _median_ms(lambda: decode_attention(q, k, v, table, rows, seq, d ** -0.5))
    ref = _median_ms(reference, repeats=5)
    return [("bench triton decode attention (32 seqs, 200-4096 keys, bf16)", "PASS" if err < 3e-2 else "FAIL",
             f"triton {ours:.3f} ms, gathered torch reference {ref:.2f} ms, max abs error {err:.2e}")]


def cuda_graph_rows() -> list[tuple[str, str, str]]:
    """The served decode step of the embedded model with CUDA graphs vs eager."""
    import step_breakdown
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    from bench_offline import chat_prompts

    model_dir = resolve_model_path(None)
    tok = get_tokenizer(model_dir)
    prompts = [apply_chat_template(tok, m) for m in chat_prompts(16)]
    steps = {}
    for label, kw in (("graphs", {}), ("eager", {"disable_cuda_graph": True})):
        sched = step_breakdown.make_scheduler(model_dir, "bfloat16", 16, device="cuda", **kw)
        if label == "graphs" and sched.runner.cuda_graph_runner is None:
            return [("bench cuda graphs", "FAIL", "graphs were not captured (see the self-check warning)")]
        steps[label] = {c: step_breakdown.breakdown(sched, prompts, c, 32, eager_split=False)["step_ms"]
                        for c in (1, 8, 16)}
        del sched
    detail = ", ".join(f"bs={c} {steps['graphs'][c]:.2f} vs {steps['eager'][c]:.2f} ms "
                       f"({steps['eager'][c] / steps['graphs'][c]:.2f}x)" for c in (1, 8, 16))
    return [("bench cuda graphs vs eager decode step", "PASS", detail)]


def sampler_rows() -> list[tuple[str, str, str]]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "bench_sampler.py"), "--device", "cuda",
                           "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-4000:])
    if proc.returncode != 0:
        return [("bench sampler on cuda", "FAIL", proc.stderr[-300:])]
    return [("bench sampler on cuda", "PASS", sampler_goal_detail(proc.stdout))]


def sampler_goal_detail(stdout: str) -> str:
    """The batch-64 ratios of bench_sampler's goal lines, e.g.
    ``V=248320 top-p 0.4x NOT met``, folded into one detail (PASS: every draw was valid)."""
    goals = [line.split() for line in stdout.splitlines() if line.strip().startswith("V=")]
    if not goals:
        return "valid draws; no goal lines in its output"
    met = sum(g[-1] == "met" and g[-2] != "NOT" for g in goals)
    ratios = ", ".join(f"{g[0]} {g[1]} {g[2]}" for g in goals)
    return f"valid draws; speed goal >= 3x at batch 64 met {met}/{len(goals)}: {ratios}"


def nccl_rows() -> list[tuple[str, str, str]]:
    if torch.cuda.device_count() < 2:
        return [("bench nccl all_reduce TP=2", "SKIP", f"{torch.cuda.device_count()} GPU(s): needs two")]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "gpu_nccl.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    ok = proc.returncode == 0 and "NCCL-OK" in proc.stdout
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return [("bench nccl all_reduce TP=2", "PASS" if ok else "FAIL", last if ok else proc.stderr[-300:])]


def run_all() -> list[tuple[str, str, str]]:
    rows = []
    for fn in (bitmask_rows, decode_attention_rows, cuda_graph_rows, sampler_rows, nccl_rows):
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            rows.append((f"bench {fn.__name__.removesuffix('_rows')}", "FAIL", f"{type(e).__name__}: {e}"[:300]))
    return rows
