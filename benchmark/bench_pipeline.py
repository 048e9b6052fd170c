"""Pipeline parallelism (--pp-size) on CPU: throughput against TP=1, where each stage's
forward time goes, and the grammar agreement's cost over the wider group -- one run.

    .venv/bin/python benchmark/bench_pipeline.py [--requests 32] [--new-tokens 64] [--rounds 3]
        [--dtype auto] [--mbs 8] [--compiled] [--iters 1000] [--repeats 10]
        [--layouts tp2,pp2,tp2xpp2] [--skip-throughput] [--skip-agreement] [--deadline 600]

A. Throughput. Real ``Scheduler``s with the embedded SmolLM2-135M, built in spawned
   processes the way the server builds its ranks (real gloo groups on loopback; CPU threads
   split between a node's ranks, as the launcher does):
   - tp1-eager: 1 process, all CPUs' threads, --disable-torch-compile;
   - pp2: 2 stages (``init_process_groups`` + ``init_pipeline_group``), cpu_count / 2
     threads each; stages run eagerly. Default micro-batching (--pp-size micro-batches a
     step), and per ``--mbs`` cap the same processes rerun with --pp-max-micro-batch-size
     set to it (more, smaller micro-batches);
   - tp1-compiled (with --compiled; for context only): TP=1 with its default compiled path.
     Off by default: the first run per --requests compiles for minutes (~4.5 min on a busy
     2-core machine); later runs load the compile cache (~30 s).
   Every rank of a group gets the same messages (``process_input_requests``) in the same
   iteration and steps in lock-step until no rank has work. A round: ``--requests``
   different short chat prompts submitted at once, greedy, ``--new-tokens`` each
   (ignore_eos); tok/s = output tokens / wall time from submission to the last finish.
   One short warm-up round per variant, then ``--rounds`` rounds, the variants' order
   reversed every other round; medians. Every round's greedy outputs must equal tp1-eager's
   first round, token for token (a MISMATCH line for a PP variant otherwise; the compiled
   path's own rounding is only noted). Per PP variant, from ``StageTimes`` summed over its
   measured rounds: each stage's forward split into compute / waiting for the previous
   stage's activations (recv) / waiting for its sends, and the bubble of the non-first
   stage, recv / (compute + recv), next to the theory (p - 1) / (m + p - 1) for m
   micro-batches per step. Printed, parsed by a checker:

       pp2 vs tp1 bs=<requests> throughput <ratio>x      (pp2 tok/s / tp1-eager tok/s)

B. Grammar agreement. For each layout (tp2: TP=2; pp2: PP=2; tp2xpp2: TP=2 x PP=2, 4 ranks
   on 2 CPUs) real ranks are spawned and ``agree_on_grammar_status`` runs over the group
   the scheduler gives its ``GrammarManager`` (``pipeline.ctrl`` at PP > 1, the TP group at
   PP = 1), 8 queued grammars whose readiness differs by rank, next to one bare 1-word
   all_reduce over the same group (bench_grammar_sync.py's method: ``--repeats`` rounds,
   alternating; the slowest rank's median over all ``--iters`` calls). Then a real
   ``GrammarManager`` over that group with an empty queue: every torch.distributed
   collective is counted while ``get_ready_grammar_requests`` runs (idle and busy), and with
   one pending grammar as the counter's own check. Printed:

       agreement <layout> <us> us bare <us> us ratio <x>x
       no-pending collectives: <count>

Targets: PP=2's greedy outputs identical to TP=1's; agreement <= 1.3x the bare all_reduce in
every layout; no collective at all while no rank has a pending grammar. Throughput has no
fixed bar here: on one 2-core machine each stage runs half the layers on one of the two
cores and idles for the bubble, so PP=2 reaches at best about m / (m + p - 1) of a TP=1 that
scales perfectly over both threads (0.67x at m = 2, 0.8x at m = 4), less the sampled ids'
broadcast. The CPU flags and dtype come first: compare figures within one run only (2
shared, drifting cores: a 2-thread rank suffers most from any other load on the machine).
The default run takes ~4-5 minutes on an idle 2-core machine (~8 under a concurrent load).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_grammar_sync as gsync  # noqa: E402 - the agreement's timing method
import machine_floor  # noqa: E402

GOAL_AGREE_RATIO = 1.3
AGREE_QUEUE = 8  # bench_grammar_sync's "8 queued, ready differs by rank"
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}  # name -> (tp, pp)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "gather", "gather_object", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "monitored_barrier")


# ---- spawned processes: one queue of commands each, one shared queue of results -------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """``n`` spawned processes running ``target(rank, cmds, out, *args)``; every wait for
    them ends by ``deadline`` (time.monotonic()) and ``close`` kills what is still alive."""

    def __init__(self, name: str, target, n: int, args: tuple, deadline: float):
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.name, self.deadline = name, deadline
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=target, args=(r, self.cmds[r], self.out) + args, daemon=True)
                      for r in range(n)]
        for p in self.procs:
            p.start()

    def send(self, cmd) -> None:
        for q in self.cmds:
            q.put(cmd)

    def collect(self) -> dict:
        """{rank: payload}, one message from every rank."""
        return gsync.collect_reports(self.out, self.procs, self.deadline, self.name, {})

    def close(self) -> None:
        self.send(("stop",))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _rank_setup(threads: int) -> None:
    from srt.process_utils import die_with_parent

    die_with_parent()
    import torch

    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)


def _get(cmds, deadline: float):
    """The next command; a parent that stops talking ends this rank."""
    return cmds.get(timeout=max(1.0, deadline - time.monotonic()))


# ---- A. throughput --------------------------------------------------------------------------
def _build_scheduler(rank: int, pp_size: int, port: int, args, compiled: bool):
    from transformers import AutoTokenizer

    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from distributed.pipeline import init_pipeline_group
    from distributed.process_groups import DistConfig, init_process_groups
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import resolve_model_path
    from srt.scheduler.scheduler import Scheduler
    from srt.server_args import ServerArgs

    if pp_size > 1:
        info = RankInfo.for_world_rank(rank, 1, 1, pp_size=pp_size)
        tp, _ = init_process_groups(info, DistConfig(f"tcp://127.0.0.1:{port}", "gloo", 120))
        pipeline = init_pipeline_group(info, 120, "gloo")
    else:
        info, tp, pipeline = RankInfo(), SINGLE_RANK, None
    path = resolve_model_path(None)
    sargs = ServerArgs(model_path=path, random_seed=0, dtype=args.dtype, pp_size=pp_size,
                       pp_layer_partition=args.pp_layer_partition if pp_size > 1 else None,
                       grammar_backend="none", max_running_requests=args.requests,
                       max_total_tokens=args.requests * (128 + args.new_tokens) + 512,
                       disable_torch_compile=not compiled, wait_for_torch_compile=compiled)
    return Scheduler(sargs, info, tp, ModelConfig.from_path(path), AutoTokenizer.from_pretrained(path),
                     pipeline=pipeline)


def _run_round(sched, prompts: list, new_tokens: int, tag: str) -> dict:
    """Submit every prompt at once, step until no rank has work; tokens per request."""
    from sampling.sampling_params import SamplingParams
    from srt.model_executor.pipeline_forward import StageTimes
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict = {rid: [] for rid in rids}
    pf = sched.runner.pipeline_forward
    if pf is not None:
        pf.times = StageTimes()
    sched.step_stats.reset()
    steps, start = 0, time.perf_counter()
    sched.process_input_requests([TokenizedGenerateReq(rid, ids, params) for rid, ids in zip(rids, prompts)])
    while sched.has_work():  # identical on every rank: the ranks step in lock-step
        for out in sched.step():
            for rid, new in zip(getattr(out, "rids", ()), getattr(out, "new_token_ids", ())):
                tokens[rid].extend(new)
        steps += 1
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "steps": steps, "tokens": [tokens[r] for r in rids],
            "times": dataclasses.asdict(pf.times) if pf is not None else None,
            "decode_ms": sched.step_stats.mode("DECODE").per_step_ms()}


def _serve_main(rank: int, cmds, out, pp_size: int, threads: int, compiled: bool, port: int, args) -> None:
    """A scheduler rank: build, report, then run rounds on command until "stop"."""
    try:
        _rank_setup(threads)
        import torch

        t0 = time.perf_counter()
        sched = _build_scheduler(rank, pp_size, port, args, compiled)
        out.put((rank, True, {"load_s": time.perf_counter() - t0, "threads": torch.get_num_threads(),
                              "dtype": str(sched.runner.dtype).removeprefix("torch.")}))
        try:
            while (cmd := _get(cmds, time.monotonic() + args.deadline))[0] != "stop":
                _, tag, prompts, new_tokens, mbs = cmd
                if sched.runner.pipeline_forward is not None:  # the same on every stage
                    sched.runner.pipeline_forward.max_micro_batch_size = mbs
                out.put((rank, True, _run_round(sched, prompts, new_tokens, tag)))
        finally:
            from distributed.process_groups import destroy_process_groups

            destroy_process_groups()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def _prompts(n: int) -> list[tuple[int, ...]]:
    from transformers import AutoTokenizer

    from bench_offline import chat_prompts
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    return [tuple(apply_chat_template(tok, msgs)) for msgs in chat_prompts(n)]


@dataclasses.dataclass
class Variant:
    label: str
    group: Ranks
    mbs: int | None = None  # --pp-max-micro-batch-size for the round
    rounds: list = dataclasses.field(default_factory=list)  # per round: {rank: result}

    def entry(self, k: int) -> dict:
        """Round ``k`` as the entry rank (the last stage) saw it."""
        res = self.rounds[k]
        return res[max(res)]

    def tok_s(self) -> list[float]:
        return [sum(map(len, self.entry(k)["tokens"])) / self.entry(k)["elapsed"] for k in range(len(self.rounds))]


def _run_variant(v: Variant, prompts, new_tokens: int, tag: str) -> dict:
    v.group.send(("round", tag, prompts, new_tokens, v.mbs))
    res = v.group.collect()
    steps = {r: x["steps"] for r, x in res.items()}
    if len(set(steps.values())) > 1 or any(x["tokens"] != res[0]["tokens"] for x in res.values()):
        print(f"MISMATCH {v.label} {tag}: the stages disagree (steps {steps})", flush=True)
    return res


def _first_diff(a: list, b: list) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check(ref: list, v: Variant, k: int, loud: bool) -> int:
    """Requests of ``v``'s round ``k`` whose greedy tokens differ from the reference."""
    bad = 0
    for i, (a, b) in enumerate(zip(ref, v.entry(k)["tokens"])):
        if a != b:
            bad += 1
            if loud:
                print(f"MISMATCH {v.label} round {k} request {i}: first difference at output token "
                      f"{_first_diff(a, b)} (lengths {len(a)} vs {len(b)})", flush=True)
    return bad


def _print_stages(v: Variant, pp_size: int) -> None:
    """Each stage's forward split, summed over the measured rounds, and the bubble."""
    tot = {r: {k: sum(v.rounds[j][r]["times"][k] for j in range(len(v.rounds)))
               for k in v.rounds[0][r]["times"]} for r in v.rounds[0]}
    for r, t in sorted(tot.items()):
        fwd = t["compute_s"] + t["recv_wait_s"] + t["send_wait_s"]
        pct = lambda key: 100 * t[key] / fwd if fwd else 0.0  # noqa: E731
        print(f"    stage {r}: forward {1e3 * fwd / t['steps']:6.1f} ms/step over {t['steps']} steps: "
              f"compute {pct('compute_s'):5.1f}%  recv wait {pct('recv_wait_s'):5.1f}%  "
              f"send wait {pct('send_wait_s'):5.1f}%")
    last = tot[max(tot)]
    m = last["micro_batches"] / last["steps"]
    bubble = last["recv_wait_s"] / (last["compute_s"] + last["recv_wait_s"])
    print(f"    bubble (stage {max(tot)}): recv / (compute + recv) {100 * bubble:.1f}%  "
          f"theory (p-1)/(m+p-1) {100 * (pp_size - 1) / (m + pp_size - 1):.1f}% "
          f"(p={pp_size}, m={m:.2f} micro-batches/step)")


def bench_throughput(args, cpus: int) -> None:
    deadline = time.monotonic() + args.deadline
    prompts = _prompts(args.requests)
    pp = 2
    groups: list[Ranks] = []
    try:
        tp1 = Ranks("tp1-eager", _serve_main, 1, (1, cpus, False, 0, args), deadline)
        pp2 = Ranks("pp2", _serve_main, pp, (pp, max(1, cpus // pp), False, _free_port(), args), deadline)
        groups += [tp1, pp2]
        variants = [Variant("tp1-eager", tp1), Variant("pp2", pp2)]
        variants += [Variant(f"pp2 mbs={m}", pp2, m) for m in args.mbs]
        if args.compiled:
            tpc = Ranks("tp1-compiled", _serve_main, 1, (1, cpus, True, 0, args), deadline)
            groups.append(tpc)
            variants.append(Variant("tp1-compiled", tpc))
        ready = {g.name: g.collect() for g in groups}  # every model loaded (and compiled)
        info = ready["tp1-eager"][0]
        print(f"dtype={info['dtype']} threads: tp1 {info['threads']}, pp2 "
              f"{ready['pp2'][0]['threads']}/rank; pp layers per stage "
              f"{args.pp_layer_partition or 'even'}; load s: "
              + ", ".join(f"{n} {max(x['load_s'] for x in r.values()):.0f}" for n, r in ready.items()), flush=True)

        for v in variants:  # warm-up, off the clock: first touches of the KV pool, caches
            _run_variant(v, prompts, min(8, args.new_tokens), f"{v.label}-warm")
        for k in range(args.rounds):
            for v in (variants if k % 2 == 0 else variants[::-1]):
                v.rounds.append(_run_variant(v, prompts, args.new_tokens, f"{v.label}-r{k}"))
            print(f"round {k}: " + ", ".join(f"{v.label} {v.tok_s()[-1]:.1f} tok/s" for v in variants), flush=True)
    finally:
        for g in groups:
            g.close()

    ref = variants[0].entry(0)["tokens"]
    n_tok = sum(map(len, ref))
    lens = sorted(map(len, prompts))
    print(f"\nA. Throughput: {args.requests} greedy requests x {args.new_tokens} new tokens at once "
          f"(prompts {lens[0]}-{lens[-1]} tokens), tok/s = {n_tok} output tokens / wall time; "
          f"median of {args.rounds} rounds [range], variants alternating")
    print(f"{'variant':<16} {'tok/s':>8} {'[range]':>15} {'steps':>6} {'decode ms/step: forward':>24} "
          f"{'sampling':>9} {'scheduler':>10}  outputs vs tp1-eager")
    rate = {}
    for v in variants:
        ts = v.tok_s()
        rate[v.label] = statistics.median(ts)
        bad = sum(_check(ref, v, k, loud=v.group is pp2) for k in range(len(v.rounds)))
        ms = v.entry(len(v.rounds) - 1)["decode_ms"]
        same = "identical" if not bad else f"{bad} request-rounds differ"
        print(f"{v.label:<16} {rate[v.label]:>8.1f} {f'[{min(ts):.1f}-{max(ts):.1f}]':>15} "
              f"{v.entry(0)['steps']:>6} {ms['forward']:>24.1f} {ms['sampling']:>9.1f} "
              f"{ms['scheduler']:>10.1f}  {same}")
    print(f"pp2 vs tp1 bs={args.requests} throughput {rate['pp2'] / rate['tp1-eager']:.2f}x")
    for v in variants[2:]:
        if v.mbs is not None:
            print(f"pp2 mbs={v.mbs} vs tp1 bs={args.requests} throughput {rate[v.label] / rate['tp1-eager']:.2f}x")
    if "tp1-compiled" in rate:
        print(f"(for context) tp1-compiled vs tp1-eager {rate['tp1-compiled'] / rate['tp1-eager']:.2f}x; "
              f"pp2 vs tp1-compiled {rate['pp2'] / rate['tp1-compiled']:.2f}x")
    print("\nPer stage, forward time split, summed over the measured rounds (prefill step included):")
    for v in variants:
        if v.group is pp2:
            print(f"  {v.label}{' (default: --pp-size micro-batches)' if v.mbs is None else ''}:")
            _print_stages(v, pp)


# ---- B. grammar agreement -------------------------------------------------------------------
def _count_collectives():
    """Wrap every torch.distributed collective with a counter; returns (counts, undo)."""
    import torch.distributed as dist

    counts = {"n": 0}
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(fn):
        def counted(*a, **kw):
            counts["n"] += 1
            return fn(*a, **kw)
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(fn))
    return counts, lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


def _no_pending_collectives(group, iters: int) -> dict:
    """Collectives run by a real GrammarManager's get_ready_grammar_requests over ``group``:
    with an empty queue (idle and busy: expected 0), and per call with one pending grammar."""
    from constrained.grammar_manager import GrammarManager

    backend = gsync._pending_backend_cls()()
    gm = GrammarManager(backend, group, abort_request=lambda req, message: None)
    counts, undo = _count_collectives()
    try:
        for idle in (True, False):
            for _ in range(iters):
                assert gm.get_ready_grammar_requests(idle=idle) == ([], [])
        empty = counts["n"]
        req = gsync._FakeReq(0)
        assert gm.process_req_with_grammar(req)  # queued, its compile never finishes
        counts["n"] = 0
        for _ in range(iters):
            req.grammar_wait_ct = 0
            assert gm.get_ready_grammar_requests(idle=False) == ([], [])
        return {"empty": empty, "calls": 2 * iters, "one_pending_per_call": counts["n"] / iters}
    finally:
        undo()
        backend.shutdown()


def _agree_main(rank: int, cmds, out, tp_size: int, pp_size: int, port: int, args) -> None:
    try:
        world = tp_size * pp_size
        _rank_setup(max(1, (os.cpu_count() or 1) // world))  # as the launcher splits the cores
        import torch
        import torch.distributed as dist

        from distributed.grammar_agreement import agree_on_grammar_status
        from distributed.parallel_state import RankInfo
        from distributed.pipeline import init_pipeline_group
        from distributed.process_groups import DistConfig, destroy_process_groups, init_process_groups

        info = RankInfo.for_world_rank(rank, tp_size, 1, pp_size=pp_size)
        tp, _ = init_process_groups(info, DistConfig(f"tcp://127.0.0.1:{port}", "gloo", 120))
        pipeline = init_pipeline_group(info, 120, "gloo")
        group = pipeline.ctrl if pipeline is not None else tp  # what the Scheduler gives its GrammarManager
        try:
            ready, failed = gsync._differs(AGREE_QUEUE)(group.rank)
            word = torch.zeros(1, dtype=torch.int64)
            reused = torch.zeros(1, dtype=torch.int64)  # as the GrammarManager reuses its own
            fns = {"agreement": lambda: agree_on_grammar_status(ready, failed, group, queue_len=AGREE_QUEUE,
                                                                word=reused),
                   "bare": lambda: dist.all_reduce(word, op=dist.ReduceOp.BAND, group=group.cpu_group)}
            barrier = lambda: dist.barrier(group=group.cpu_group)  # noqa: E731
            res = {"size": group.size, "timed": gsync._rounds(fns, args, barrier)}
            res["count"] = _no_pending_collectives(group, 100)
            dist.barrier(group=group.cpu_group)
        finally:
            destroy_process_groups()
        out.put((rank, True, res))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def bench_agreement(args) -> None:
    per_round = max(10, args.iters // args.repeats)
    print(f"\nB. Grammar agreement ({AGREE_QUEUE} queued, ready differs by rank) over the scheduler's "
          f"grammar group vs one bare 1-word all_reduce over the same group, gloo; us per call: the "
          f"slowest rank's median of {args.repeats} rounds x {per_round} calls [range of round medians]")
    verdicts = []
    for name in args.layouts:
        tp_size, pp_size = LAYOUTS[name]
        n = tp_size * pp_size
        group = Ranks(name, _agree_main, n, (tp_size, pp_size, _free_port(), args), time.monotonic() + 120)
        try:
            res = group.collect()
        finally:
            group.close()
        # A collective ends together on every rank: the slowest rank's median is what a step pays.
        a, b = (max((res[r]["timed"][lb] for r in res), key=lambda t: t[0]) for lb in ("agreement", "bare"))
        ratio = a[0] / b[0]
        verdicts.append(ratio <= GOAL_AGREE_RATIO)
        which = "pipeline.ctrl" if pp_size > 1 else "TP group"
        print(f"  {name}: {n} ranks, group of {res[0]['size']} ({which}): round medians: agreement "
              f"[{1e6 * a[1]:.0f}-{1e6 * a[2]:.0f}] us, bare [{1e6 * b[1]:.0f}-{1e6 * b[2]:.0f}] us")
        print(f"agreement {name} {1e6 * a[0]:.1f} us bare {1e6 * b[0]:.1f} us ratio {ratio:.2f}x", flush=True)
        empty = sum(res[r]["count"]["empty"] for r in res)
        one = max(res[r]["count"]["one_pending_per_call"] for r in res)
        print(f"no-pending collectives: {empty} ({name}: {res[0]['count']['calls']} calls x {n} ranks, idle and "
              f"busy; counter check: {one:.0f} per call with 1 pending)", flush=True)
        verdicts.append(empty == 0 and one >= 1)
    print(f"target: agreement <= {GOAL_AGREE_RATIO}x bare in every layout, 0 collectives with nothing pending: "
          f"{'PASS' if all(verdicts) else 'FAIL'}")


def main() -> None:
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the server's allocator (the spawned ranks inherit it)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32, help="concurrent greedy requests per round")
    ap.add_argument("--new-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per variant")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has native bf16, else fp32")
    ap.add_argument("--mbs", type=int, nargs="*", default=[8],
                    help="--pp-max-micro-batch-size values also measured at PP=2 (none: skip)")
    ap.add_argument("--pp-layer-partition", default=None,
                    help="layers per stage for the PP variants (e.g. 19,11; default: even)")
    ap.add_argument("--compiled", action="store_true",
                    help="also TP=1 with its default compiled path (first run per --requests: minutes)")
    ap.add_argument("--iters", type=int, default=1000, help="timed agreement calls per variant and layout")
    ap.add_argument("--repeats", type=int, default=10, help="rounds the agreement calls are split into")
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                    help=f"comma-separated, of {','.join(LAYOUTS)}")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds for part A before giving up")
    args = ap.parse_args()
    if unknown := set(args.layouts) - set(LAYOUTS):
        ap.error(f"unknown layouts {sorted(unknown)}")
    from srt.model_executor.model_runner import cpu_has_native_bf16

    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    cpus = os.cpu_count() or 1
    t0 = time.monotonic()
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={args.dtype} cpus={cpus}",
          flush=True)
    if not args.skip_throughput:
        bench_throughput(args, cpus)
    if not args.skip_agreement:
        bench_agreement(args)
    print(f"(total {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
