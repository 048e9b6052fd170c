"""Offline throughput: gramsync Engine vs transformers `generate`, same model, same run.

    .venv/bin/python benchmark/bench_offline.py [--num-prompts 64] [--max-new-tokens 128]
        [--concurrency 32] [--repeats 1]

Both sides run the same chat prompts greedily and produce exactly --max-new-tokens tokens
per prompt (ignore_eos / min_new_tokens), transformers in left-padded batches of
--concurrency, ours with --max-running-requests=--concurrency. Prints tokens/s and the
ratio, plus batch-1 time per output token for each.
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


def bench_ours(model_path, prompts_ids, max_new, concurrency, repeats):
    from srt import Engine

    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    with Engine(model_path=model_path, max_running_requests=concurrency,
                max_total_tokens=concurrency * (max_new + 128) + 512) as eng:
        eng.generate(prompts_ids[:2], params)  # warm-up
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = eng.generate(prompts_ids, params)
            dt = time.perf_counter() - t
            rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / dt)
        one = {**params, "max_new_tokens": 32}
        t = time.perf_counter()
        o = eng.generate(prompts_ids[0], one)
        tpot = (time.perf_counter() - t) / o["meta_info"]["completion_tokens"]
    return statistics.median(rates), tpot


def bench_hf(model_dir, prompts_ids, max_new, concurrency, repeats, pad_id):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(batch_ids, n_new):
        width = max(len(x) for x in batch_ids)
        ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=pad_id)
        return (out.shape[1] - width) * len(batch_ids)

    run(prompts_ids[:2], 4)  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(run(prompts_ids[i:i + concurrency], max_new)
                for i in range(0, len(prompts_ids), concurrency))
        rates.append(n / (time.perf_counter() - t))
    t = time.perf_counter()
    n = run(prompts_ids[:1], 32)
    return statistics.median(rates), (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    from srt.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    model_dir = resolve_model_path(args.model_path)
    tok = get_tokenizer(model_dir)
    prompts_ids = [apply_chat_template(tok, m) for m in chat_prompts(args.num_prompts)]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    ours, ours_tpot = bench_ours(model_dir, prompts_ids, args.max_new_tokens,
                                 args.concurrency, args.repeats)
    hf, hf_tpot = bench_hf(model_dir, prompts_ids, args.max_new_tokens, args.concurrency,
                           args.repeats, pad_id)
    print(f"prompts={args.num_prompts} new_tokens={args.max_new_tokens} "
          f"concurrency={args.concurrency} threads={torch.get_num_threads()}")
    print(f"throughput  gramsync {ours:8.1f} tok/s   transformers {hf:8.1f} tok/s   "
          f"ratio {ours / hf:.2f}x")
    print(f"batch-1 TPOT gramsync {ours_tpot * 1000:7.1f} ms    transformers {hf_tpot * 1000:7.1f} ms    "
          f"ratio {hf_tpot / ours_tpot:.2f}x (higher is better for gramsync)")


if __name__ == "__main__":
    main()
