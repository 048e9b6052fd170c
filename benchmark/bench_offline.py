"""Offline throughput: gramsync Engine vs transformers `generate`, same model, same run.

    .venv/bin/python benchmark/bench_offline.py [--num-prompts 64] [--max-new-tokens 128]
        [--concurrency 32] [--repeats 1]

Both sides run the same chat prompts greedily (ignore_eos / min_new_tokens), transformers
in left-padded static batches of --concurrency, ours with --max-running-requests equal to
--concurrency, in the same dtype. Two workloads: "uniform" (every request produces
--max-new-tokens tokens: static batching's best case) and "mixed" (requests ask for 8 to
--max-new-tokens tokens, as real traffic does). Prints useful tokens/s and the ratio for
each, plus batch-1 time per output token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

TOPICS = ["the ocean", "compilers", "bread baking", "black holes", "chess openings",
          "honey bees", "the Roman empire", "solar panels", "jazz", "volcanoes",
          "public transport", "origami", "the immune system", "rainforests", "typography",
          "glaciers"]
ASKS = ["Write a short poem about {}.", "Explain {} to a child.",
        "List three surprising facts about {}.", "Give me a one-paragraph history of {}."]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)])}]
            for i in range(n)]


def bench_ours(model_path, prompts_ids, workloads, concurrency, repeats, dtype):
    """workloads: name -> per-prompt new-token counts. Returns ({name: tok/s}, batch-1 TPOT)."""
    from srt import Engine

    longest = max(max(w) for w in workloads.values())
    rates = {}
    with Engine(model_path=model_path, max_running_requests=concurrency, dtype=dtype,
                max_total_tokens=concurrency * (longest + 128) + 512) as eng:
        eng.generate(prompts_ids[:2], {"max_new_tokens": 4})  # warm-up
        for name, lengths in workloads.items():
            params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
            runs = []
            for _ in range(repeats):
                t = time.perf_counter()
                outs = eng.generate(prompts_ids, params)
                runs.append(sum(o["meta_info"]["completion_tokens"] for o in outs)
                            / (time.perf_counter() - t))
            rates[name] = statistics.median(runs)
        t = time.perf_counter()
        o = eng.generate(prompts_ids[0], {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
        tpot = (time.perf_counter() - t) / o["meta_info"]["completion_tokens"]
    return rates, tpot


def bench_hf(model_dir, prompts_ids, workloads, concurrency, repeats, pad_id, dtype):
    """Static batches of ``concurrency``; a batch runs until its longest request is done,
    and only the tokens each request asked for count as useful output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def run(batch_ids, n_new):
        width = max(len(x) for x in batch_ids)
        ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=pad_id)
        assert out.shape[1] - width == n_new

    run(prompts_ids[:2], 4)  # warm-up
    rates = {}
    for name, lengths in workloads.items():
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            for i in range(0, len(prompts_ids), concurrency):
                run(prompts_ids[i:i + concurrency], max(lengths[i:i + concurrency]))
            runs.append(sum(lengths) / (time.perf_counter() - t))
        rates[name] = statistics.median(runs)
    t = time.perf_counter()
    run(prompts_ids[:1], 32)
    return rates, (time.perf_counter() - t) / 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="same dtype for both sides (auto: what the server would pick)")
    ap.add_argument("--skip-hf", action="store_true", help="only run gramsync")
    args = ap.parse_args()

    from srt.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    model_dir = resolve_model_path(args.model_path)
    tok = get_tokenizer(model_dir)
    prompts_ids = [apply_chat_template(tok, m) for m in chat_prompts(args.num_prompts)]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    from srt.model_runner import resolve_dtype
    from srt.server_args import ServerArgs

    dtype = str(resolve_dtype(ServerArgs(dtype=args.dtype), "cpu")).removeprefix("torch.")
    n, m = args.num_prompts, args.max_new_tokens
    workloads = {
        "uniform": [m] * n,  # static batching's best case: every request equally long
        "mixed": [8 + (i * 37) % (m - 7) for i in range(n)],  # lengths 8..m, as in serving
    }
    ours, ours_tpot = bench_ours(model_dir, prompts_ids, workloads, args.concurrency,
                                 args.repeats, dtype)
    print(f"prompts={n} max_new_tokens={m} dtype={dtype} concurrency={args.concurrency} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (medians)")
    if args.skip_hf:
        print(f"gramsync {ours} tok/s, batch-1 TPOT {ours_tpot * 1000:.1f} ms")
        return
    hf, hf_tpot = bench_hf(model_dir, prompts_ids, workloads, args.concurrency, args.repeats,
                           pad_id, dtype)
    for name in workloads:
        print(f"throughput {name:8s} gramsync {ours[name]:7.1f} tok/s   transformers "
              f"{hf[name]:7.1f} tok/s   ratio {ours[name] / hf[name]:.2f}x")
    print(f"batch-1 TPOT       gramsync {ours_tpot * 1000:7.1f} ms      transformers "
          f"{hf_tpot * 1000:7.1f} ms      ratio {hf_tpot / ours_tpot:.2f}x (higher: gramsync faster)")


if __name__ == "__main__":
    main()
