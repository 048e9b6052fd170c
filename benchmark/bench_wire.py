"""ZMQ wire-format micro-benchmark on CPU: our typed msgpack codec vs pickle.

    .venv/bin/python benchmark/bench_wire.py [--batch-sizes 1,8,32,64] [--repeats 7]
        [--min-loop-ms 20]

What crosses the frontend <-> scheduler sockets, encoded and decoded once per message
(``srt/transport/wire.py``; the reference is ``pickle.dumps(protocol=HIGHEST)`` /
``pickle.loads``, what ``send_pyobj``/``recv_pyobj`` did before):

- "step": one scheduler step's ``BatchTokenOut`` for B running requests (32-hex-char rids,
  one new token each, every 4th request finishing with a mix of FinishReasons, the rest
  None), via FRONTEND_INPUT_CODEC;
- "request": one ``TokenizedGenerateReq`` (200 input ids; SamplingParams with a
  json_schema, stop strings, logit_bias, seed), via SCHEDULER_INPUT_CODEC;
- "burst": 64 such requests arriving in one step (64 messages, each encoded and decoded).

Each repeat times a loop of N encode+decode calls of each side, alternating the sides (N
is calibrated once so a loop takes about --min-loop-ms); times are the median over
--repeats of the per-message (per-step for "burst") time in microseconds, after one
warm-up loop. "ratio" is pickle / ours (> 1: ours is faster). Both sides are checked to
give back a message equal to the original.
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sampling.sampling_params import SamplingParams  # noqa: E402
from srt.transport.io_struct import (  # noqa: E402
    FRONTEND_INPUT_CODEC,
    SCHEDULER_INPUT_CODEC,
    BatchTokenOut,
    FinishReason,
    TokenizedGenerateReq,
)

VOCAB = 49152
BURST = 64
PROMPT_LEN = 200


def cpu_summary() -> str:
    """One line: the CPU model, cores and the SIMD flags that matter to gramsync on CPU."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", "x86_64"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return f"CPU: {model}, {os.cpu_count()} cores; /proc/cpuinfo unreadable (flags unknown)"
    shown = ", ".join(f"{f}={'yes' if f in flags else 'no'}"
                      for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    return f"CPU: {model}, {os.cpu_count()} cores; flags: {shown}"


# ---- messages -----------------------------------------------------------------------------
def _rid(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


_FINISHES = (FinishReason("stop", matched=2), FinishReason("stop", matched="</answer>"),
             FinishReason("length", matched=256),
             FinishReason("abort", message="Request aborted by the client.", status_code=499))


def make_step(batch: int, seed: int = 0) -> BatchTokenOut:
    rng = random.Random(seed)
    reasons = tuple(_FINISHES[(i // 4) % len(_FINISHES)] if i % 4 == 3 else None
                    for i in range(batch))
    return BatchTokenOut(
        rids=tuple(_rid(rng) for _ in range(batch)),
        new_token_ids=tuple((rng.randrange(VOCAB),) for _ in range(batch)),
        finished_reasons=reasons,
        prompt_tokens=tuple(rng.randrange(16, 4096) for _ in range(batch)),
        completion_tokens=tuple(rng.randrange(1, 256) for _ in range(batch)),
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[^@]+@[^@]+\\.[a-z]{2,}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"$ref": "#/$defs/address"},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "status"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]}},
}


def make_request(seed: int = 0) -> TokenizedGenerateReq:
    rng = random.Random(seed)
    params = SamplingParams.from_dict({
        "max_new_tokens": 256, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 1234,
        "stop": ["</answer>", "\n\nUser:", "<|im_end|>"], "stop_token_ids": [2],
        "logit_bias": {str(rng.randrange(VOCAB)): rng.choice((-100.0, -5.0, 2.5, 10.0))
                       for _ in range(8)},
        "json_schema": SCHEMA,
    })
    return TokenizedGenerateReq(rid=_rid(rng), input_ids=tuple(rng.randrange(VOCAB) for _ in
                                                              range(PROMPT_LEN)),
                                sampling_params=params, stream=True)


# ---- timing -------------------------------------------------------------------------------
def _sides(codec):
    enc, dec = codec.encode, codec.decode
    dumps, loads, proto = pickle.dumps, pickle.loads, pickle.HIGHEST_PROTOCOL

    def ours(msgs):
        for m in msgs:
            dec(enc(m))

    def ref(msgs):
        for m in msgs:
            loads(dumps(m, proto))

    return ours, ref


def _loop_us(fn, msgs, n: int) -> float:
    """Microseconds per call of fn(msgs), over a loop of n calls (gc off, as timeit)."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            fn(msgs)
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        if gc_was:
            gc.enable()


def _calibrate(fns, msgs, min_loop_ms: float) -> int:
    """Loop length so the slower side's loop takes about min_loop_ms."""
    n = 1
    while True:
        slowest = max(_loop_us(fn, msgs, n) * n for fn in fns) / 1e3
        if slowest >= min_loop_ms or n >= 1 << 20:
            return n
        n = max(n * 2, int(n * min_loop_ms / max(slowest, 1e-3)) + 1)


def time_case(codec, msgs: list, repeats: int, min_loop_ms: float) -> tuple[float, float]:
    """Median microseconds (ours, pickle) to encode+decode all of msgs once."""
    ours, ref = _sides(codec)
    for m in msgs:  # both sides give back what they were given
        assert codec.decode(codec.encode(m)) == m
        assert pickle.loads(pickle.dumps(m, pickle.HIGHEST_PROTOCOL)) == m
    n = _calibrate((ours, ref), msgs, min_loop_ms)
    times = ([], [])
    for i in range(repeats + 1):
        for fn, ts in zip((ours, ref), times):
            us = _loop_us(fn, msgs, n)
            if i:  # the first round is the warm-up
                ts.append(us)
    return statistics.median(times[0]), statistics.median(times[1])


def run_wire_bench(repeats: int = 7, batch_sizes=(1, 8, 32, 64), min_loop_ms: float = 20.0
                   ) -> list[dict]:
    """One dict per case: case, what, ours_us, pickle_us, ratio, ours_bytes, pickle_bytes."""
    cases = [(f"step B={b}", f"1 BatchTokenOut, {b} requests", FRONTEND_INPUT_CODEC,
              [make_step(b, seed=b)]) for b in batch_sizes]
    cases.append(("request", f"1 TokenizedGenerateReq, {PROMPT_LEN} ids", SCHEDULER_INPUT_CODEC,
                  [make_request()]))
    cases.append((f"burst {BURST}", f"{BURST} TokenizedGenerateReq in one step",
                  SCHEDULER_INPUT_CODEC, [make_request(seed=i) for i in range(BURST)]))
    rows = []
    for name, what, codec, msgs in cases:
        ours_us, pickle_us = time_case(codec, msgs, repeats, min_loop_ms)
        rows.append(dict(
            case=name, what=what, ours_us=ours_us, pickle_us=pickle_us, ratio=pickle_us / ours_us,
            ours_bytes=sum(len(codec.encode(m)) for m in msgs),
            pickle_bytes=sum(len(pickle.dumps(m, pickle.HIGHEST_PROTOCOL)) for m in msgs)))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'case':<11} {'messages':<38} {'ours us':>9} {'pickle us':>10} {'ratio':>7} "
          f"{'ours B':>8} {'pickle B':>9}")
    for r in rows:
        print(f"{r['case']:<11} {r['what']:<38} {r['ours_us']:>9.2f} {r['pickle_us']:>10.2f} "
              f"{r['ratio']:>6.2f}x {r['ours_bytes']:>8} {r['pickle_bytes']:>9}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64",
                    help="running requests per scheduler step (BatchTokenOut size)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-loop-ms", type=float, default=20.0,
                    help="each timed loop runs about this long")
    args = ap.parse_args()
    import msgspec

    print(cpu_summary())
    print(f"Python {platform.python_version()}, msgspec {msgspec.__version__}, pickle protocol "
          f"{pickle.HIGHEST_PROTOCOL}; encode+decode per message, median of {args.repeats} "
          f"loops after a warm-up; ratio = pickle / ours (> 1: ours is faster)\n")
    t0 = time.perf_counter()
    rows = run_wire_bench(args.repeats, [int(x) for x in args.batch_sizes.split(",")],
                          args.min_loop_ms)
    print_rows(rows)
    faster = sum(r["ratio"] > 1.0 for r in rows)
    print(f"\nours faster than pickle in {faster} of {len(rows)} cases "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
