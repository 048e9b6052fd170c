"""Offline speed: gramsync vs transformers `generate`, same model, same dtype, same run.

    .venv/bin/python benchmark/bench_offline.py [--num-prompts 64] [--max-new-tokens 128]
        [--concurrency 32] [--breakdown 1,2,4,8,16,32,64] [--dtype auto] [--json out.json]
        [--torchao-config int8wo] [--disable-torch-compile] [--enable-mixed-chunk]

1. Machine: CPU flags, dtype, threads, and this run's physical floors (read bandwidth,
   matmul peak) -> the model's decode floors (machine_floor.py).
2. Per-step breakdown of ours at each --breakdown concurrency (step_breakdown.py): the
   served decode step (compiled where it is) split into forward / sampling / grammar /
   scheduler, its ratio to the floor, and the eager forward's attention / linear / other.
3. Throughput through the Engine (scheduler processes + IPC + detokenizer), greedy,
   ignore_eos, vs transformers in left-padded static batches of --concurrency: "uniform"
   (every request makes --max-new-tokens: static batching's best case) and "mixed" (8 to
   --max-new-tokens, as real traffic asks); plus batch-1 time per output token. The
   difference between the Engine's batch-1 step and the in-process one is IPC + frontend.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import machine_floor
import step_breakdown

TOPICS = ["the ocean", "compilers", "bread baking", "black holes", "chess openings",
          "honey bees", "the Roman empire", "solar panels", "jazz", "volcanoes",
          "public transport", "origami", "the immune system", "rainforests", "typography",
          "glaciers"]
ASKS = ["Write a short poem about {}.", "Explain {} to a child.",
        "List three surprising facts about {}.", "Give me a one-paragraph history of {}."]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)])}]
            for i in range(n)]


def bench_ours(model_path, prompts_ids, workloads, concurrency, repeats, dtype, server_kwargs):
    """workloads: name -> per-prompt new-token counts. Returns ({name: tok/s}, batch-1 TPOT)."""
    from srt import Engine

    longest = max(max(w) for w in workloads.values())
    rates = {}
    with Engine(model_path=model_path, max_running_requests=concurrency, dtype=dtype,
                max_total_tokens=concurrency * (longest + 128) + 512, wait_for_torch_compile=True,
                **server_kwargs) as eng:
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
        o = eng.generate(prompts_ids[0], {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True})
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
    run(prompts_ids[:1], 64)
    return rates, (time.perf_counter() - t) / 64


FLOOR_SIZES = (1, 2, 4, 8, 16)


def print_breakdown(rows, floors) -> None:
    print("\nper decode step, ms (in-process scheduler; served path; eager forward split by hooks)")
    print(f"{'conc':>5}{'step':>8}{'floor':>8}{'x floor':>8}{'forward':>9}{'sampling':>9}{'grammar':>8}"
          f"{'sched':>7} |{'eager':>7}{'attn':>7}{'linear':>8}{'other':>7}")
    for r in rows:
        c, p = r["concurrency"], r["phases_ms"]
        e = r.get("eager_forward_ms", {"attention": 0.0, "linear": 0.0, "other": 0.0})
        floor = max(floors["batch1_ms"], floors["compute_ms_per_row"] * c)
        r["floor_ms"], r["x_floor"] = floor, r["step_ms"] / floor
        print(f"{c:>5}{r['step_ms']:>8.1f}{floor:>8.1f}{r['x_floor']:>8.2f}{p['forward']:>9.1f}"
              f"{p['sampling']:>9.2f}{p['grammar']:>8.2f}{p['scheduler']:>7.2f} |{r.get('eager_step_ms', 0.0):>7.1f}"
              f"{e['attention']:>7.1f}{e['linear']:>8.1f}{e['other']:>7.1f}")
    # The small-batch target's lines (issue format; checks read them): served step vs floor.
    for r in rows:
        if r["concurrency"] in FLOOR_SIZES:
            print(f"floor bs={r['concurrency']} step {r['step_ms']:.1f} ms floor {r['floor_ms']:.1f} ms "
                  f"ratio {r['x_floor']:.2f}x")


def main():
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--breakdown", default="1,2,4,8,16,32,64", help="concurrencies for the step breakdown ('' skips)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="same dtype for both sides (auto: what the server would pick, and the "
                         "weights it serves by default: a 4-bit GGUF's own codes)")
    ap.add_argument("--no-eager-split", action="store_true",
                    help="skip the eager pass that splits the forward (bf16 on a CPU without native "
                         "bf16 runs its eager matmuls at well under 1 GFLOP/s)")
    ap.add_argument("--package-profile", default="",
                    help="concurrencies whose compiled step is profiled inside its package "
                         "(package_profile.py; builds a second set of packages with Inductor's "
                         "kernel profiling, minutes)")
    ap.add_argument("--torchao-config", default=None)
    ap.add_argument("--disable-torch-compile", action="store_true")
    ap.add_argument("--enable-mixed-chunk", action="store_true",
                    help="the Engine prefills arriving requests in the decode steps' forward")
    ap.add_argument("--http-overhead", default="1,8",
                    help="batch sizes streamed through a real HTTP server, compared with the "
                         "breakdown's in-process step (http_overhead.py; '' skips)")
    ap.add_argument("--skip-hf", action="store_true", help="only run gramsync")
    ap.add_argument("--skip-throughput", action="store_true", help="floors and breakdown only")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    from srt.model_executor.model_loader import resolve_model_path
    from srt.model_executor.model_runner import resolve_dtype
    from srt.server_args import ServerArgs
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    model_dir = resolve_model_path(args.model_path)
    tok = get_tokenizer(model_dir)
    prompts_ids = [apply_chat_template(tok, m) for m in chat_prompts(args.num_prompts)]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dtype = str(resolve_dtype(ServerArgs(dtype=args.dtype), "cpu")).removeprefix("torch.")
    # What the server is given: "auto" keeps a 4-bit GGUF's default (its own codes); a named
    # dtype serves it dequantized. transformers gets the named dtype.
    served_dtype = args.dtype
    server_kwargs = {"torchao_config": args.torchao_config,
                     "disable_torch_compile": args.disable_torch_compile,
                     "enable_mixed_chunk": args.enable_mixed_chunk}
    report = {"args": vars(args), "dtype": dtype, "threads": torch.get_num_threads(),
              "cpu": machine_floor.cpu_model(), "cpu_flags": machine_floor.cpu_flags()}
    bw = machine_floor.read_bandwidth_gbs()
    peak = machine_floor.matmul_peak_gflops(getattr(torch, dtype))
    report.update(read_gbs=bw, matmul_gflops=peak)
    from srt.model_executor.cpu_allocator import loaded_allocator

    report["allocator"] = os.path.basename(loaded_allocator() or "glibc")
    print(f"cpu={report['cpu']} flags={report['cpu_flags']} dtype={dtype} threads={report['threads']} "
          f"torchao={args.torchao_config} compile={not args.disable_torch_compile} "
          f"allocator={report['allocator']}")
    print(f"floors: read {bw:.1f} GB/s, {dtype} matmul {peak:.0f} GFLOP/s")

    levels = [int(c) for c in args.breakdown.split(",") if c]
    if levels:
        sched = step_breakdown.make_scheduler(model_dir, served_dtype, max(levels), **server_kwargs)
        report["weights"] = "the GGUF's own 4-bit codes" if sched.runner.gguf_int4 else "checkpoint"
        print(f"weights served: {report['weights']}")
        floors = machine_floor.model_floors(sched.runner.model, getattr(torch, dtype), bw, peak)
        print(f"model: {floors['weight_bytes'] / 1e6:.0f} MB of weights -> batch-1 floor "
              f"{floors['batch1_ms']:.1f} ms; {floors['per_row_gflop']:.2f} GFLOP per token -> "
              f"{floors['compute_ms_per_row']:.2f} ms per row of a batch")
        report["floors"] = floors
        report["breakdown"] = [step_breakdown.breakdown(sched, prompts_ids, c, 48, not args.no_eager_split)
                               for c in levels]
        print_breakdown(report["breakdown"], floors)
        del sched
    http_sizes = [int(c) for c in args.http_overhead.split(",") if c]
    if http_sizes:
        import http_overhead

        steps = {r["concurrency"]: r["step_ms"] for r in report.get("breakdown", [])}
        missing = [bs for bs in http_sizes if bs not in steps]
        if missing:
            raise SystemExit(f"--http-overhead {missing}: not in --breakdown, no in-process step to compare")
        flags = ["--dtype", served_dtype]
        if args.torchao_config:
            flags += ["--torchao-config", args.torchao_config]
        if args.disable_torch_compile:
            flags.append("--disable-torch-compile")
        http_ms, cpu = http_overhead.measure(model_dir, flags, prompts_ids, http_sizes, new_tokens=48)
        print("\nthe same greedy requests streamed through HTTP (POST /v1/completions, 48 tokens as the breakdown, medians)")
        report["http_tpot_ms"], report["http_cpu_ms_per_step"] = http_ms, cpu
        http_overhead.print_cpu(cpu)
        report["http_overhead_ms"] = http_overhead.print_overhead(http_ms, steps)
    profiled = [int(c) for c in args.package_profile.split(",") if c]
    if profiled:
        import package_profile

        os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"  # a builder process too
        # Packages of their own, never those built without it (the key does not tell them apart).
        os.environ["GRAMSYNC_COMPILE_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "gramsync-kernel-profile")
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
        sched = step_breakdown.make_scheduler(model_dir, served_dtype, max(profiled), **server_kwargs)
        report["package_profile"] = [package_profile.profile_decode(sched, prompts_ids, c, 24) for c in profiled]
        package_profile.print_profile(report["package_profile"])
        del sched
    if not args.skip_throughput:
        n, m = args.num_prompts, args.max_new_tokens
        workloads = {"uniform": [m] * n, "mixed": [8 + (i * 37) % (m - 7) for i in range(n)]}
        ours, ours_tpot = bench_ours(model_dir, prompts_ids, workloads, args.concurrency,
                                     args.repeats, served_dtype, server_kwargs)
        report["ours"] = {"tok_s": ours, "batch1_tpot_ms": 1e3 * ours_tpot}
        one = next((r for r in report.get("breakdown", []) if r["concurrency"] == 1), None)
        if one is not None:  # same step through processes, ZMQ and the detokenizer
            report["ipc_frontend_ms_per_step"] = 1e3 * ours_tpot - one["step_ms"]
            print(f"\nIPC + frontend per batch-1 step: {report['ipc_frontend_ms_per_step']:.1f} ms "
                  f"(Engine TPOT {1e3 * ours_tpot:.1f} - in-process step {one['step_ms']:.1f})")
        print(f"\nprompts={n} max_new_tokens={m} concurrency={args.concurrency} repeats={args.repeats} (medians)")
        if args.skip_hf:
            print(f"gramsync {ours} tok/s, batch-1 TPOT {ours_tpot * 1000:.1f} ms")
        else:
            hf, hf_tpot = bench_hf(model_dir, prompts_ids, workloads, args.concurrency, args.repeats, pad_id, dtype)
            report["transformers"] = {"tok_s": hf, "batch1_tpot_ms": 1e3 * hf_tpot}
            for name in workloads:
                print(f"throughput {name:8s} gramsync {ours[name]:7.1f} tok/s   transformers "
                      f"{hf[name]:7.1f} tok/s   ratio {ours[name] / hf[name]:.2f}x")
            print(f"batch-1 TPOT       gramsync {ours_tpot * 1000:7.1f} ms      transformers "
                  f"{hf_tpot * 1000:7.1f} ms      ratio {ours_tpot / hf_tpot:.2f}x (lower: gramsync faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
