"""Per-step cost of the cross-rank grammar agreement: old vs new, and next to a real
decode step, same TP, same run.

    .venv/bin/python benchmark/bench_grammar_sync.py [--tp 2 4] [--iters 200] [--repeats 5]
        [--batch 32] [--decode-steps 8] [--rounds 3] [--dtype auto] [--deadline 240] [--skip-decode]

For each TP size, ``tp`` real ranks are spawned (gloo on CPU, as the server does). On every
rank:

0. Old vs new, same inputs, same run: ``agree_on_grammar_status`` (one bitwise-AND
   all_reduce of a queue-position bitmap; messages are exchanged only after a failure)
   against the previous implementation, kept here only as the reference (a pickled
   ``all_gather_object`` of (ready, failed)). Each case runs ``--repeats`` rounds of
   ``--iters / --repeats`` calls of each, the order alternating per round; printed: the
   slowest rank's median over all calls, the range of the round medians, and old / new.
   The floor is one bare 1-word all_reduce. The token agreement (``agree_on_sampled_ids``:
   all_reduce MIN of the ids over the device group) is timed next to the alternatives
   (the CPU group; all_gather + local min).
1. Grammar agreement inside the manager: a real ``GrammarManager`` over the rank's TP
   group, with a backend whose compiles never finish, so its queue holds 0, 1 or 64
   *pending* grammars. While the queue is non-empty every scheduler iteration polls it and
   runs the agreement, so this is the cost paid on every decode step while constrained
   requests wait for their compile. ``get_ready_grammar_requests(idle=False)`` -- what a
   busy scheduler calls -- is timed ``--iters`` times per queue size; the median per call
   is reported. With an empty queue no collective runs at all.
2. A real decode step (skipped with ``--skip-decode``): the embedded SmolLM2, TP-sharded,
   in the real ``Scheduler`` (``--batch`` short greedy requests; only decode steps are
   timed). The same steps are also timed end to end with 0, 1 and 64 pending grammars in
   the scheduler's own grammar queue (interleaved in ``--rounds`` rounds, the order
   rotated each round, so drift and position effects hit all three alike).

Printed per TP: agreement median (us), decode step median (ms), and their ratio; the goals
are <= 200 us per agreement, < 2 % of a decode step while grammars are pending and ~0 with
none.
"""
from __future__ import annotations

import argparse
import os
import queue as queue_mod
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PENDING = (0, 1, 64)
GOAL_PENDING_PCT = 2.0
GOAL_AGREE_US = 200.0  # per grammar agreement without failures (issue 15, part 8)
GOAL_NONE_US = 5.0  # "~0": no collective, just an empty-list check
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fibonacci(n):", "Hello", "Name three colors:", "Once upon a time",
           "The best way to learn is"]


def _pending_backend_cls():
    from constrained.base_grammar_backend import BaseGrammarBackend

    class PendingBackend(BaseGrammarBackend):
        """Every compile blocks until shutdown: its futures stay pending."""

        name = "pending"

        def __init__(self):
            super().__init__(num_threads=1)
            self.gate = threading.Event()

        def dispatch(self, key):
            self.gate.wait()
            raise RuntimeError("benchmark over")

        def shutdown(self):
            self.gate.set()
            super().shutdown()

    return PendingBackend


class _FakeReq:
    """The fields GrammarManager reads from a request."""

    def __init__(self, i: int):
        from types import SimpleNamespace

        self.rid = f"g{i}"
        self.sampling_params = SimpleNamespace(constraint=("regex", f"[a-z]{{{i + 1}}}"))
        self.grammar_key = self.grammar_future = self.grammar = self.finished_reason = None
        self.grammar_wait_ct = 0
        self.require_reasoning = False


def _timed(fn, n: int, warmup: int = 10) -> list[float]:
    """Seconds per call of ``fn`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _old_agree(ready: set[int], failed: dict[int, str], tp) -> tuple[set[int], dict[int, str]]:
    """The previous ``agree_on_grammar_status`` (its multi-rank path, unchanged): "old"."""
    import torch.distributed as dist

    gathered: list = [None] * tp.size
    dist.all_gather_object(gathered, (sorted(ready), failed), group=tp.cpu_group)
    agreed_failed: dict[int, str] = {}
    for _, rank_failed in gathered:
        for idx, message in rank_failed.items():
            agreed_failed.setdefault(idx, message)
    agreed_ready = set.intersection(*(set(r) for r, _ in gathered))
    return agreed_ready - agreed_failed.keys(), agreed_failed


def _differs(n: int):
    """Ready sets that differ per rank (2 of every 3 positions, shifted by rank)."""
    return lambda rank: ({i for i in range(n) if (i + rank) % 3}, {})


def _rank1_fails(rank: int):
    """Queue of 8, all ready, but rank 1 failed position 3 (the slow path)."""
    return (set(range(8)) - {3}, {3: "Failed to compile regex grammar"}) if rank == 1 else (set(range(8)), {})


CASES = (  # (name, queue length, rank -> its (ready, failed)); "fail" in the name: slow path
    ("64 pending, none ready", 64, lambda rank: (set(), {})),
    ("8 queued, ready differs by rank", 8, _differs(8)),
    ("64 queued, ready differs by rank", 64, _differs(64)),
    ("200 queued, ready differs by rank", 200, _differs(200)),
    ("8 queued, rank 1 fails one", 8, _rank1_fails),
)


def _rounds(fns: dict, args, barrier) -> dict:
    """{label: (median s over all calls, min and max round median)}: ``--repeats`` rounds,
    the labels' order alternating per round so drift hits every label alike."""
    per_round = max(10, args.iters // args.repeats)
    calls: dict = {k: [] for k in fns}
    medians: dict = {k: [] for k in fns}
    order = list(fns)
    for k in range(args.repeats):
        for label in (order if k % 2 == 0 else order[::-1]):
            barrier()
            t = _timed(fns[label], per_round, warmup=3)
            calls[label] += t
            medians[label].append(statistics.median(t))
    return {k: (statistics.median(calls[k]), min(medians[k]), max(medians[k])) for k in fns}


def _bench_old_vs_new(tp, args, barrier) -> dict:
    import torch
    import torch.distributed as dist

    from distributed.grammar_agreement import agree_on_grammar_status
    from distributed.token_agreement import agree_on_sampled_ids

    out = {}
    for name, n, inputs in CASES:
        ready, failed = inputs(tp.rank)
        new = lambda: agree_on_grammar_status(ready, failed, tp, queue_len=n)  # noqa: E731
        old = lambda: _old_agree(ready, failed, tp)  # noqa: E731
        assert new() == old(), f"{name}: new and old disagree"
        out[name] = _rounds({"old": old, "new": new}, args, barrier)
    word = torch.zeros(1, dtype=torch.int64)
    out["floor"] = _rounds({"new": lambda: dist.all_reduce(word, op=dist.ReduceOp.BAND, group=tp.cpu_group)},
                           args, barrier)

    warnings.filterwarnings("ignore", ".*all_gather_into_tensor", FutureWarning)  # torch >= 2.4 has it

    def gather_min(ids):
        parts = torch.empty(tp.size * ids.numel(), dtype=ids.dtype)
        dist.all_gather_into_tensor(parts, ids, group=tp.device_group)
        return parts.view(tp.size, -1).amin(0)

    def cpu_min(ids):
        agreed = ids.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.cpu_group)
        return agreed

    for b in sorted({1, args.batch, 256}):
        ids = torch.randint(0, 49152, (b,))
        out[f"token {b}"] = _rounds({"product": lambda: agree_on_sampled_ids(ids, tp),
                                     "cpu group": lambda: cpu_min(ids),
                                     "all_gather+min": lambda: gather_min(ids)}, args, barrier)
    return out


def _bench_agreement(tp, args, barrier) -> dict:
    from constrained.grammar_manager import GrammarManager

    backend = _pending_backend_cls()()
    gm = GrammarManager(backend, tp, abort_request=lambda req, message: None)
    reqs = [_FakeReq(i) for i in range(max(PENDING))]
    for r in reqs:
        assert gm.process_req_with_grammar(r)  # a miss: queued, future pending
    out = {}
    try:
        for n in PENDING:
            gm.grammar_queue = reqs[:n]
            for r in reqs:
                r.grammar_wait_ct = 0  # never reach SGLANG_GRAMMAR_MAX_POLL_ITERATIONS

            def call():
                ready, failed = gm.get_ready_grammar_requests(idle=False)
                assert not ready and not failed

            barrier()
            out[n] = statistics.median(_timed(call, args.iters))
            assert len(gm.grammar_queue) == n
    finally:
        backend.shutdown()
    return out


def _bench_decode(info, tp, args, barrier) -> dict:
    import torch
    from transformers import AutoTokenizer

    from constrained.grammar_manager import GrammarManager
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import AbortReq, TokenizedGenerateReq
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import resolve_model_path
    from srt.server_args import ServerArgs

    path = resolve_model_path(None)
    warm = 2
    max_new = warm + args.rounds * len(PENDING) * args.decode_steps + 8
    sargs = ServerArgs(model_path=path, tp_size=info.tp_size, random_seed=0, dtype=args.dtype,
                       grammar_backend="none", max_running_requests=args.batch,
                       max_total_tokens=args.batch * (32 + max_new))
    tok = AutoTokenizer.from_pretrained(path)
    sched = Scheduler(sargs, info, tp, ModelConfig.from_path(path), tok)
    # The real GrammarManager on the scheduler's TP group, with compiles that never finish.
    backend = _pending_backend_cls()()
    gm = sched.grammar_manager = GrammarManager(backend, tp, **sched.grammar_manager_kwargs())
    try:
        params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
        plain = [TokenizedGenerateReq(f"d{i}", tuple(tok.encode(PROMPTS[i % len(PROMPTS)])), params)
                 for i in range(args.batch)]
        cons = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]+"})
        waiting_g = [TokenizedGenerateReq(f"g{i}", (1, 2, 3), cons) for i in range(max(PENDING))]
        sched.process_input_requests(plain)
        while sched.waiting:  # prefill (no grammars queued yet)
            sched.step()
        assert len(sched.running) == args.batch, "the whole batch must decode together"
        sched.process_input_requests(waiting_g)
        queued = list(gm.grammar_queue)
        assert len(queued) == max(PENDING)
        times: dict[int, list[float]] = {n: [] for n in PENDING}
        gm.grammar_queue = []
        for _ in range(warm):
            sched.step()
        for k in range(args.rounds):
            for n in PENDING[k % 3:] + PENDING[:k % 3]:  # rotate: no size always goes first
                gm.grammar_queue = queued[:n]
                barrier()
                for _ in range(args.decode_steps):
                    assert not sched.waiting and len(sched.running) == args.batch
                    t0 = time.perf_counter()
                    sched.step()
                    times[n].append(time.perf_counter() - t0)
        assert all(not r.finished for r in sched.running)
        gm.grammar_queue = queued
        sched.process_input_requests([AbortReq(m.rid, "benchmark over") for m in plain + waiting_g])
        sched.step()
        assert not sched.has_work()
        return {"step": {n: statistics.median(v) for n, v in times.items()},
                "token_steps": sched.step_stats.token_agreement_steps, "token_mismatches": sched.step_stats.token_mismatches,
                "dtype": str(sched.runner.dtype).removeprefix("torch."), "threads": torch.get_num_threads()}
    finally:
        backend.shutdown()


def _rank_main(rank: int, tp_size: int, port: int, args, out) -> None:
    try:
        from srt.process_utils import die_with_parent

        die_with_parent()
        import torch
        import torch.distributed as dist

        torch.set_grad_enabled(False)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))  # as the server does
        from distributed.parallel_state import RankInfo
        from distributed.process_groups import DistConfig, destroy_process_groups, init_process_groups

        info = RankInfo.for_world_rank(rank, tp_size, 1)
        tp, _ = init_process_groups(info, DistConfig(f"tcp://127.0.0.1:{port}", "gloo", 120))

        def barrier():
            dist.barrier(group=tp.cpu_group)

        try:
            res = {"cmp": _bench_old_vs_new(tp, args, barrier), "agree": _bench_agreement(tp, args, barrier)}
            if not args.skip_decode:
                res.update(_bench_decode(info, tp, args, barrier))
        finally:
            destroy_process_groups()
        out.put((rank, True, res))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def collect_reports(out, procs, deadline: float, name: str, got: dict) -> dict:
    """Fill ``got`` with one ``(rank, ok, payload)`` report per process from ``out`` by
    ``deadline`` (time.monotonic()); a failed rank, a rank that died silently or the
    deadline raise. Also used by bench_pipeline.py."""
    while len(got) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{name}: only ranks {sorted(got)} answered before the deadline")
        try:
            rank, ok, payload = out.get(timeout=min(left, 1.0))
        except queue_mod.Empty:
            bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if bad:
                raise RuntimeError(f"{name}: a rank exited with {bad} without reporting")
            continue
        if not ok:
            raise RuntimeError(f"{name} rank {rank} failed:\n{payload}")
        got[rank] = payload
    return got


def run_tp(tp_size: int, args) -> dict:
    """Spawn ``tp_size`` ranks; return {rank: results}. Kills every rank on error/deadline."""
    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, port, args, out), daemon=True)
             for r in range(tp_size)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        collect_reports(out, procs, time.monotonic() + args.deadline, f"TP={tp_size}", results)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == tp_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def _slowest(res: dict, key: str) -> dict:
    """{label: (median, lo, hi)} of the rank with the largest median per label: a
    collective ends together on every rank, so the slowest rank is what the step pays."""
    labels = res[0]["cmp"][key]
    return {lb: max((res[r]["cmp"][key][lb] for r in res), key=lambda v: v[0]) for lb in labels}


def _print_old_vs_new(rows, args, verdicts) -> None:
    per_round = max(10, args.iters // args.repeats)
    print(f"\nGrammar agreement, old (all_gather_object) vs new (bitmap all_reduce BAND), gloo on CPU; "
          f"us per call: median of {args.repeats} rounds x {per_round} calls [range of round medians], "
          f"slowest rank")
    print(f"{'tp':>3}  {'case':<34} {'old us':>22} {'new us':>22} {'old/new':>8}")
    us = lambda v: f"{1e6 * v[0]:8.1f} [{1e6 * v[1]:.0f}-{1e6 * v[2]:.0f}]"  # noqa: E731
    for tp, res in rows:
        floor = _slowest(res, "floor")["new"]
        for name, _, _ in CASES:
            c = _slowest(res, name)
            print(f"{tp:>3}  {name:<34} {us(c['old']):>22} {us(c['new']):>22} {c['old'][0] / c['new'][0]:>7.1f}x")
            if "fail" not in name:
                verdicts.append((f"TP={tp} {name}: {1e6 * c['new'][0]:.0f} us (goal <= {GOAL_AGREE_US:.0f} us; "
                                 f"floor {1e6 * floor[0]:.0f} us)", 1e6 * c["new"][0] <= GOAL_AGREE_US))
        print(f"{tp:>3}  {'floor: one bare 1-word all_reduce':<34} {'':>22} {us(floor):>22}")
    print(f"\nToken agreement (all_reduce MIN of int64 ids), us per call, same format")
    print(f"{'tp':>3} {'ids':>5} {'product: device group':>26} {'CPU group':>22} {'all_gather + min':>22}")
    for tp, res in rows:
        for key in (k for k in res[0]["cmp"] if k.startswith("token ")):
            c = _slowest(res, key)
            print(f"{tp:>3} {key.split()[1]:>5} {us(c['product']):>26} {us(c['cpu group']):>22} "
                  f"{us(c['all_gather+min']):>22}")


def _print_decode(rows, args, verdicts) -> None:
    print(f"\nGrammar agreement vs decode step, SmolLM2-135M, batch {args.batch}, median of {args.iters} "
          f"agreement calls / {args.rounds * args.decode_steps} decode steps per row")
    print(f"{'tp':>3} {'pending':>8} {'agreement us':>13} {'decode step ms':>15} {'ratio %':>8}"
          f" {'step ms w/ pending':>19} {'delta %':>8}")
    for tp, res in rows:
        r0 = res[0]
        agree = {n: max(res[r]["agree"][n] for r in res) for n in PENDING}
        base = r0["step"][0] if "step" in r0 else None
        for n in PENDING:
            a_us = 1e6 * agree[n]
            if base is None:
                print(f"{tp:>3} {n:>8} {a_us:>13.1f}")
            else:
                ratio, delta = 100 * agree[n] / base, 100 * (r0["step"][n] - base) / base
                print(f"{tp:>3} {n:>8} {a_us:>13.1f} {1e3 * base:>15.2f} {ratio:>8.3f}"
                      f" {1e3 * r0['step'][n]:>19.2f} {delta:>+8.2f}")
            if n == 0:
                verdicts.append((f"TP={tp} none pending: {a_us:.1f} us (goal ~0, < {GOAL_NONE_US:.0f} us)",
                                 a_us < GOAL_NONE_US))
            elif base is not None:
                verdicts.append((f"TP={tp} {n} pending: {ratio:.2f}% of a decode step "
                                 f"(goal < {GOAL_PENDING_PCT:.0f}%)", ratio < GOAL_PENDING_PCT))
        if base is not None:
            print(f"    TP={tp}: dtype {r0['dtype']}, {r0['threads']} torch thread(s)/rank; token agreement in the "
                  f"timed steps: {sum(res[r]['token_mismatches'] for r in res)} mismatches over "
                  f"{r0['token_steps']} steps (the timed batch is unconstrained)")
    print("agreement us: get_ready_grammar_requests(idle=False), the slowest rank's median per call "
          "(0 pending: no collective). step ms w/ pending / delta: the scheduler's decode step timed end "
          "to end with that many grammars pending in its queue, vs none (noisy at this scale).")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpus = os.cpu_count() or 1
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4] if cpus >= 4 else [2],
                    help="TP sizes (default: 2 and 4 with >= 4 CPUs, else 2)")
    ap.add_argument("--iters", type=int, default=200, help="timed agreement calls per case and variant")
    ap.add_argument("--repeats", type=int, default=5, help="rounds the old-vs-new calls are split into")
    ap.add_argument("--batch", type=int, default=32, help="decode batch size (and token agreement ids)")
    ap.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per queue size per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (0, 1, 64 pending) decode timings")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds per TP size before giving up")
    ap.add_argument("--skip-decode", action="store_true", help="agreement timings only (no model load)")
    args = ap.parse_args()

    t0 = time.monotonic()
    rows = [(tp, run_tp(tp, args)) for tp in args.tp]
    print(f"\n{_cpu_name()}, {cpus} CPUs; TP ranks share them (TP=4 on 2 CPUs: 2 ranks per CPU)")
    verdicts: list = []
    _print_old_vs_new(rows, args, verdicts)
    _print_decode(rows, args, verdicts)
    ok = all(v for _, v in verdicts)
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} -- " + "; ".join(
        f"{text}{'' if v else ' [MISSED]'}" for text, v in verdicts))
    print(f"(total {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
