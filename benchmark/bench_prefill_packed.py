"""The compiled prefill over a GGUF's model: packed dense rows against the plain dense weight,
alternating on one in-process scheduler.

    LD_PRELOAD=<mimalloc> .venv/bin/python benchmark/bench_prefill_packed.py [--lens 38,300]
        [--rounds 5] [--per-round 8] [--dtype auto]

The served default for the shipped GGUF keeps the file's 4-bit codes for steps of a few
rows and the dequantized weight for larger ones (srt/model_executor/gguf_int4.py). A prefill
of many tokens reads the dense rows: oneDNN-packed once at load (``gramsync::onednn_linear``,
srt/layers/cpu_packed_linear.py) or, as before, the plain weight through ``aten::mm``, which
re-lays it out on every call. Both are compiled graphs of the same halves: "plain" drops the
packed rows from every layer (``SmallBatchQuantized.dense = None``), so Dynamo traces the old
path beside the new one. Each round times ``--per-round`` fresh prompts of each length (random
ids, nothing cached), one request per step, both ways in alternating order. Prints the
median step per length and way, their ratio (packed over plain: lower is better) and how
many rounds packed won. The served processes preload mimalloc (cpu_allocator.py); run this
with the same ``LD_PRELOAD`` to time what a server runs.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine_floor  # noqa: E402
from ab_rounds import PrefillTimer, ab_rounds, report  # noqa: E402
import step_breakdown  # noqa: E402


def _set_packed(model: torch.nn.Module, packed: dict) -> None:
    from srt.layers.cpu_qgemv import SmallBatchQuantized

    for name, m in model.named_modules():
        if isinstance(getattr(m, "packed_weight", None), SmallBatchQuantized):
            m.packed_weight = m.packed_weight._replace(dense=packed.get(name))


def main() -> None:
    from srt.layers.cpu_qgemv import SmallBatchQuantized
    from srt.model_executor.model_loader import embedded_gguf_path, resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", default="38,300", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    sched = step_breakdown.make_scheduler(resolve_model_path(embedded_gguf_path()), args.dtype, 16)
    runner = sched.runner
    packed = {name: m.packed_weight.dense for name, m in runner.model.named_modules()
              if isinstance(getattr(m, "packed_weight", None), SmallBatchQuantized)}
    if not packed or any(d is None for d in packed.values()):
        raise SystemExit("no packed dense rows here (not a GGUF's codes, or packing off / unsupported)")
    if runner.compiled_switch.prefill is None:
        raise SystemExit("the compiled prefill is not in use here")
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={runner.dtype} "
          f"threads={torch.get_num_threads()} malloc={os.path.basename(os.environ.get('LD_PRELOAD', 'glibc'))}")
    rnd, timer = random.Random(0), PrefillTimer(sched)

    def prefill_ms(n: int) -> float:
        return timer([rnd.randrange(100, 40000) for _ in range(n)])

    times = ab_rounds({"packed": lambda: _set_packed(runner.model, packed),
                       "plain": lambda: _set_packed(runner.model, {})}, lens, prefill_ms, args.rounds, args.per_round)
    if not runner.compiled_switch.prefill.ready:
        raise SystemExit("the compiled prefill fell back to eager during the rounds")
    report(times, "prefill {n} tokens")

if __name__ == "__main__":
    main()
