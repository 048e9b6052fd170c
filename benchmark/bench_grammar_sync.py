"""Per-step cost of the cross-rank grammar agreement next to a real decode step, same TP, same run.

    .venv/bin/python benchmark/bench_grammar_sync.py [--tp 2 4] [--iters 200] [--batch 32]
        [--decode-steps 8] [--rounds 3] [--dtype auto] [--deadline 240]

For each TP size, ``tp`` real ranks are spawned (gloo on CPU, as the server does). On every
rank:

1. Grammar agreement, isolated: a real ``GrammarManager`` over the rank's TP group, with a
   backend whose compiles never finish, so its queue holds 0, 1 or 64 *pending* grammars.
   While the queue is non-empty every scheduler iteration polls it and runs the agreement
   (``all_gather_object`` over the TP CPU group), so this is the cost paid on every decode
   step while constrained requests wait for their compile. ``get_ready_grammar_requests
   (idle=False)`` -- what a busy scheduler calls -- is timed ``--iters`` times per queue
   size; the median per call is reported. With an empty queue no collective runs at all.
   The token agreement (``agree_on_sampled_ids``: an all-reduce MIN of ``--batch`` ids,
   run on every decode step whose batch holds grammars) is timed the same way.
2. A real decode step: the embedded SmolLM2, TP-sharded, in the real ``Scheduler``
   (``--batch`` short greedy requests; only decode steps are timed). The same steps are
   also timed end to end with 0, 1 and 64 pending grammars in the scheduler's own grammar
   queue (interleaved in ``--rounds`` rounds, the order rotated each round, so drift and
   position effects hit all three alike).

Printed per TP: agreement median (us), decode step median (ms), and their ratio; the goal
is < 2 % while grammars are pending and ~0 with none.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PENDING = (0, 1, 64)
GOAL_PENDING_PCT = 2.0
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


def _bench_agreement(tp, args, barrier) -> dict:
    import torch

    from constrained.grammar_manager import GrammarManager
    from distributed.token_agreement import agree_on_sampled_ids

    backend = _pending_backend_cls()()
    gm = GrammarManager(backend, tp)
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
        ids = torch.randint(0, 49152, (args.batch,))
        barrier()
        out["token"] = statistics.median(_timed(lambda: agree_on_sampled_ids(ids, tp), args.iters))
    finally:
        backend.shutdown()
    return out


def _bench_decode(info, tp, args, barrier) -> dict:
    import torch
    from transformers import AutoTokenizer

    from constrained.grammar_manager import GrammarManager
    from sampling.sampling_params import SamplingParams
    from srt.managers.io_struct import AbortReq, TokenizedGenerateReq
    from srt.managers.scheduler import Scheduler
    from srt.model_config import ModelConfig
    from srt.model_loader import resolve_model_path
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
    gm = sched.grammar_manager = GrammarManager(backend, tp, info.log_prefix)
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
                "token_steps": sched.token_agreement_steps, "token_mismatches": sched.token_mismatches,
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
            res = {"agree": _bench_agreement(tp, args, barrier)}
            res.update(_bench_decode(info, tp, args, barrier))
        finally:
            destroy_process_groups()
        out.put((rank, True, res))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


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
    results, deadline = {}, time.monotonic() + args.deadline
    try:
        while len(results) < tp_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"TP={tp_size}: ranks {sorted(results)} finished within {args.deadline} s")
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if bad:
                    raise RuntimeError(f"TP={tp_size}: a rank exited with {bad} without reporting")
                continue
            if not ok:
                raise RuntimeError(f"TP={tp_size} rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == tp_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpus = os.cpu_count() or 1
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4] if cpus >= 4 else [2],
                    help="TP sizes (default: 2 and 4 with >= 4 CPUs, else 2)")
    ap.add_argument("--iters", type=int, default=200, help="timed agreement calls per queue size")
    ap.add_argument("--batch", type=int, default=32, help="decode batch size")
    ap.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per queue size per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (0, 1, 64 pending) decode timings")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds per TP size before giving up")
    args = ap.parse_args()

    t0 = time.monotonic()
    rows = []
    for tp in args.tp:
        res = run_tp(tp, args)
        r0 = res[0]
        # A collective ends together on every rank; the slowest rank is what the step pays.
        agree = {n: max(res[r]["agree"][n] for r in res) for n in (*PENDING, "token")}
        rows.append((tp, r0, agree, res))

    print(f"\nGrammar agreement vs decode step, gloo on CPU ({cpus} CPUs), SmolLM2-135M, "
          f"batch {args.batch}, median of {args.iters} agreement calls / "
          f"{args.rounds * args.decode_steps} decode steps per row")
    print(f"{'tp':>3} {'pending':>8} {'agreement us':>13} {'decode step ms':>15} {'ratio %':>8}"
          f" {'step ms w/ pending':>19} {'delta %':>8}")
    verdicts = []
    for tp, r0, agree, res in rows:
        base = r0["step"][0]
        for n in PENDING:
            a_us = 1e6 * agree[n]
            ratio = 100 * agree[n] / base
            delta = 100 * (r0["step"][n] - base) / base
            print(f"{tp:>3} {n:>8} {a_us:>13.1f} {1e3 * base:>15.2f} {ratio:>8.3f}"
                  f" {1e3 * r0['step'][n]:>19.2f} {delta:>+8.2f}")
            if n == 0:
                verdicts.append((f"TP={tp} none pending: {a_us:.1f} us (goal ~0, < {GOAL_NONE_US:.0f} us)",
                                 a_us < GOAL_NONE_US))
            else:
                verdicts.append((f"TP={tp} {n} pending: {ratio:.2f}% of a decode step (goal < {GOAL_PENDING_PCT:.0f}%)",
                                 ratio < GOAL_PENDING_PCT))
        tok_ratio = 100 * agree["token"] / base
        print(f"{tp:>3} {'token':>8} {1e6 * agree['token']:>13.1f} {1e3 * base:>15.2f} {tok_ratio:>8.3f}"
              f"   (agree_on_sampled_ids, {args.batch} ids; runs on decode steps with grammars)")
        print(f"    TP={tp}: dtype {r0['dtype']}, {r0['threads']} torch thread(s)/rank; token agreement in the "
              f"timed steps: {sum(res[r]['token_mismatches'] for r in res)} mismatches over "
              f"{r0['token_steps']} steps (the timed batch is unconstrained)")
    print("\nagreement us: get_ready_grammar_requests(idle=False), the slowest rank's median per call "
          "(0 pending: no collective). step ms w/ pending / delta: the scheduler's decode step timed end "
          "to end with that many grammars pending in its queue, vs none (noisy at this scale).")
    ok = all(v for _, v in verdicts)
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} -- " + "; ".join(
        f"{text}{'' if v else ' [MISSED]'}" for text, v in verdicts))
    print(f"(total {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
