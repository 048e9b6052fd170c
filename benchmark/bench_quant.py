"""Weight-only quantization against the same engine unquantized, same run.

    .venv/bin/python benchmark/bench_quant.py [--torchao-config gguf|int8wo|int4wo-32] [--dtype auto]

``gguf`` is the default for the embedded 4-bit GGUF on CPU: its own Q4_1 codes on torch's
int4 kernel (srt/model_executor/gguf_int4.py) in steps of up to 4 rows (its eager row's
greedy tokens and perplexity are measured with the codes at every row); ``int8wo`` and
``int4wo-<g>`` re-quantize the dequantized weights with torchao. "unquantized" is the dequantized model in ``--dtype``
(auto: the machine's default dtype, named explicitly so it stays dense).

With an int4 config on CPU it also runs the int4 model compiled and prints
``int4 vs <dtype> compiled: ratio <x>x`` (int4's batch-1 step over the unquantized
compiled step of the same dtype). With ``gguf`` it also runs the model dequantized to bf16
and prints ``perplexity vs bf16-dequantized: <+x.xx>%`` and the greedy agreement with it.

For each of {unquantized, quantized}, on the in-process scheduler, both eager and the
unquantized default (compiled; int8wo is not compiled by default, CPU int4 is):
batch-1 time per output token (median decode step), greedy tokens on the benchmark prompts
(agreement = share of positions equal to the unquantized eager run's, up to the first
difference per prompt), and perplexity of benchmark/data/perplexity_text.txt.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch

import step_breakdown
from bench_offline import chat_prompts

TEXT = Path(__file__).with_name("data") / "perplexity_text.txt"


def perplexity(sched, ids: list[int]) -> float:
    """exp(mean NLL) of every token after the first, from one prefill's logits."""
    from sampling.sampling_params import SamplingParams
    from srt.scheduler.req import Req

    req = Req("ppl", tuple(ids), SamplingParams.from_dict({"max_new_tokens": 1}), False,
              frozenset(), False)
    fb = sched.kv.prepare_extend([req])
    fb.return_all_logits = True
    logits = sched.runner.forward(fb).float()
    sched.kv.release(req)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def greedy(sched, prompts_ids, n: int, tag: str) -> list[list[int]]:
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    msgs = [TokenizedGenerateReq(f"{tag}-{i}", tuple(p), params) for i, p in enumerate(prompts_ids)]
    sched.process_input_requests(msgs)
    reqs = [sched.reqs[m.rid] for m in msgs]
    while sched.has_work():
        sched.step()
    return [list(r.output_ids) for r in reqs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same, total = same + k, total + len(x)
    return same / total


def main() -> None:
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torchao-config", default="int8wo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    path = resolve_model_path(None)
    tok = get_tokenizer(path)
    prompts = [apply_chat_template(tok, m) for m in chat_prompts(16)]
    text_ids = tok(TEXT.read_text())["input_ids"]
    from srt.model_executor.gguf_int4 import codes_at_every_row
    from srt.model_executor.model_runner import resolve_dtype
    from srt.server_args import ServerArgs

    dense = str(resolve_dtype(ServerArgs(dtype=args.dtype), "cpu")).removeprefix("torch.")
    gguf = args.torchao_config == "gguf"  # the default: dtype auto, no torchao config
    quant = {} if gguf else {"torchao_config": args.torchao_config}
    qdtype = "auto" if gguf else args.dtype
    configs = {"unquantized eager": (dense, {"disable_torch_compile": True}),
               f"{args.torchao_config} eager": (qdtype, {**quant, "disable_torch_compile": True}),
               "unquantized compiled": (dense, {})}
    int4 = gguf or args.torchao_config.startswith("int4wo-")
    if int4:  # CPU int4 compiles (AOTInductor packages at TP=1, as the plain model)
        configs[f"{args.torchao_config} compiled"] = (qdtype, {**quant, "enable_torch_compile": True})
    if gguf and dense != "bfloat16":  # the reference: the file dequantized to bf16
        configs["bf16-dequantized eager"] = ("bfloat16", {"disable_torch_compile": True})
    rows, outputs, ref = {}, {}, None
    for name, (dtype, kwargs) in configs.items():
        sched = step_breakdown.make_scheduler(path, dtype, 16, **kwargs)
        step_breakdown._decode(sched, prompts[:1], 4, f"w{name}")
        tpot = statistics.median(step_breakdown._decode(sched, prompts[:1], 48, f"t{name}"))
        if gguf and name == "gguf eager":  # 16 prompts and the prefill would read the dense rows
            codes_at_every_row(sched.runner.model)
        out = greedy(sched, prompts, args.new_tokens, f"g{name}")
        ref, outputs[name] = ref or out, out
        rows[name] = (1e3 * tpot, agreement(out, ref), perplexity(sched, text_ids), sched.runner.dtype)
        del sched
    base = rows["unquantized eager"][0]
    import machine_floor
    from srt.model_executor.cpu_allocator import loaded_allocator

    print(f"\ncpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} threads={torch.get_num_threads()} "
          f"allocator={os.path.basename(loaded_allocator() or 'glibc')}")
    print(f"\nbatch-1 decode, {len(text_ids)}-token perplexity text, greedy agreement over "
          f"{len(prompts)} prompts x {args.new_tokens} tokens")
    print(f"{'config':<24}{'dtype':>16}{'TPOT ms':>9}{'vs eager':>9}{'agree':>7}{'ppl':>8}")
    for name, (tpot, agree, ppl, dt) in rows.items():
        print(f"{name:<24}{str(dt):>16}{tpot:>9.1f}{tpot / base:>9.2f}{agree:>7.3f}{ppl:>8.3f}")
    if int4:  # the line (checks read it): int4 compiled vs this dtype's compiled step
        dt = str(rows["unquantized compiled"][3]).removeprefix("torch.").replace("bfloat16", "bf16")
        ratio = rows[f"{args.torchao_config} compiled"][0] / rows["unquantized compiled"][0]
        print(f"int4 vs {dt} compiled: ratio {ratio:.2f}x")
        print(f"perplexity change: {100 * (rows[f'{args.torchao_config} eager'][2] / rows['unquantized eager'][2] - 1):+.2f}%")
    if gguf:
        bf16 = "bf16-dequantized eager" if "bf16-dequantized eager" in rows else "unquantized eager"
        print(f"perplexity vs bf16-dequantized: {100 * (rows['gguf eager'][2] / rows[bf16][2] - 1):+.2f}%")
        print(f"greedy agreement with bf16-dequantized: {agreement(outputs['gguf eager'], outputs[bf16]):.3f}")


if __name__ == "__main__":
    main()
