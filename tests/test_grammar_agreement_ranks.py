"""Multi-rank through the real server: ranks whose grammar compiles finish at different
times (tests/rank_skew_grammar_plugin.py) never disagree on what to run. Two layouts of two
ranks each: ``--tp-size 2`` (world rank 1 is TP rank 1) and ``--pp-size 2`` (world rank 1 is
pipeline stage 1, the last: it samples and talks to the frontend; grammar agreement spans
both stages).

Every rank writes the batches it runs (GRAMSYNC_BATCH_LOG_DIR); the two ranks' logs must
be identical line for line, whatever the compile skew, a compile that fails on one rank
only, or a compile that exceeds the poll budget on one rank only.

One module-scoped server per layout serves all tests (~10-30 s to start on 2 cores; the
whole file ~35-55 s per layout).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import _launch_server

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Polls advance once per scheduler iteration: ~5 ms idle, one decode step (30-100 ms) busy.
# 400 >> the 0-300 ms skew; HANGONRANK1 times out after ~7-10 s with traffic (measured).
MAX_POLLS = 400
REQUEST_TIMEOUT_S = 60  # every request here takes < 15 s; bounds the cost of a hang
TIMEOUT_MESSAGE = (f"Grammar preprocessing timed out: the regex grammar was not compiled within "
                   f"{MAX_POLLS} scheduler polls (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS).")
INJECTED = "rankskew injected compile failure on rank 1"
PROMPTS = ["Write a number:", "Answer yes or no. Is the sky blue?", "Name a color:",
           "Say something short.", "Give me a word:", "The capital of France is"]


# world rank 1 skews more (and FAILONRANK1 / HANGONRANK1 act there): TP rank 1, or stage 1.
LAYOUTS = {"tp2": (["--tp-size", "2"], ("DP0_TP0", "DP0_TP1")),
           "pp2": (["--pp-size", "2"], ("DP0_PP0_TP0", "DP0_PP1_TP0"))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def skew_server(request, tmp_path_factory, smollm2_dir):
    """(client, batch-log dir, rankskew log dir, the two ranks' names: world rank 0, 1)."""
    flags, ranks = LAYOUTS[request.param]
    logs = tmp_path_factory.mktemp("batch_logs")
    skew_logs = tmp_path_factory.mktemp("skew_logs")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])),
           "GRAMSYNC_BATCH_LOG_DIR": str(logs), "RANKSKEW_LOG_DIR": str(skew_logs),
           "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS": str(MAX_POLLS)}
    args = [*flags, "--grammar-backend-plugins", "rank_skew_grammar_plugin",
            "--grammar-backend", "rankskew",
            "--constrained-json-max-whitespace", "2",  # JSON outputs end within max_new_tokens
            "--enable-mixed-chunk"]  # arrivals prefill beside the running requests' decode rows
    for base in _launch_server(tmp_path_factory, smollm2_dir, args, env):
        with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S,
                          limits=httpx.Limits(max_connections=32)) as client:
            yield client, logs, skew_logs, ranks


# ---- helpers ---------------------------------------------------------------------------
def _rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def _send(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """(status, final JSON): the response body, or for a stream its last data chunk."""
    if not body.get("stream"):
        r = client.post("/generate", json=body)
        return r.status_code, r.json()
    last = None
    with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            last = json.loads(data)
    assert done and last is not None, f"stream {body.get('rid')} ended without [DONE]"
    return 200, last


def _send_all(client, bodies: list[dict], workers: int = 12) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda b: _send(client, b), bodies))


def _read_log(path) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _identical_batch_logs(log_dir, timeout: float = 15.0, ranks=("DP0_TP0", "DP0_TP1")
                          ) -> list[tuple[int, str, list[str]]]:
    """The batch logs of ``ranks`` (names, e.g. DP0_PP1_TP0), asserted identical and
    non-empty: [(step, mode, rids)]. Waits briefly: a rank may still be writing its last
    line when the response arrives."""
    deadline = time.monotonic() + timeout
    while True:
        logs = [_read_log(log_dir / f"batches_{rank}.log") for rank in ranks]
        a = logs[0]
        if (a and all(other == a for other in logs[1:])) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert a, f"{ranks[0]} wrote no batches"
    for rank, b in zip(ranks[1:], logs[1:]):
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            pytest.fail(f"batch logs differ at line {i} ({ranks[0]} {len(a)} lines, {rank} {len(b)} lines):\n"
                        f"{ranks[0]}: {a[i - 2:i + 3]}\n{rank}: {b[i - 2:i + 3]}")
    batches = []
    for line in a:
        step, mode, rids = line.split(" ", 2)
        if mode == "AGREE":  # token agreement after a batch with grammars
            assert rids == "0", f"a rank's own sample differed from the agreed ids: {line}"
            assert int(step) == len(batches) - 1, line
            continue
        if mode in ("CACHE", "FORCED", "VERIFIED", "ROUTING"):  # radix digest / forced / speculated tokens / experts
            assert int(step) == len(batches) - 1, line  # (equal on both ranks: lines matched)
            continue
        assert int(step) == len(batches), f"steps not consecutive at: {line}"
        assert mode in ("EXTEND", "DECODE", "MIXED"), line
        batches.append((int(step), mode, rids.split(",")))
    return batches


def _agreement_steps(log_dir, rank: str) -> int:
    """Batches whose sampled ids went through the token agreement (TP: the MIN all-reduce;
    PP: the last stage's ids broadcast), all with 0 mismatches (checked by
    _identical_batch_logs)."""
    return sum(1 for line in _read_log(log_dir / f"batches_{rank}.log") if " AGREE " in line)


def _logged_rids(batches) -> set[str]:
    return {rid for _, _, rids in batches for rid in rids}


def _assert_settled(client) -> None:
    """No request is left in flight and the server (both ranks) is alive."""
    assert client.get("/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while (n := client.get("/get_server_info", timeout=10).json()["num_inflight_requests"]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert n == 0, f"{n} request(s) still in flight after every response came back"


def _regex_body(rid: str, regex: str, **sp) -> dict:
    params = {"regex": regex, "max_new_tokens": 16, "temperature": 0, **sp}
    return {"text": "Write a number:", "rid": rid, "sampling_params": params}


# ---- the mixed workload of test 1 ------------------------------------------------------
def _mixed_requests(n: int, start: int = 0, tag: str = "t1") -> list[tuple[dict, str, object]]:
    """(body, kind, check) for ``n`` requests: unconstrained, regex, json_schema, choice
    and ebnf, every spec unique (no cache hit skips a compile), some streamed, some sampled
    at temperature 0.8 with a seed, varied max_new_tokens."""
    kinds = ["plain", "regex", "json_schema", "choice", "ebnf", "regex", "plain", "json_schema"]
    out = []
    for i in range(start, start + n):
        kind = kinds[i % len(kinds)]
        sp: dict = {"temperature": 0}
        if i % 3 == 1:
            sp = {"temperature": 0.8, "seed": 1000 + i}
        check = None
        if kind == "plain":
            sp["max_new_tokens"] = 2 + (i * 7) % 11
        elif kind == "regex":
            pattern = [r"[0-9]{3}", r"(yes|no)", r"[A-Z][a-z]{1,4}", r"[0-9]{1,2}-[0-9]{1,2}"][i % 4]
            regex = f"(q{i}z|{pattern})"  # unique spec, same language plus one literal
            sp.update(regex=regex, max_new_tokens=16)
            check = ("regex", regex)
        elif kind == "json_schema":
            key = f"k{i}"
            schema = {"type": "object", "properties": {key: {"enum": ["x", "y", "z"]}},
                      "required": [key], "additionalProperties": False}
            sp.update(json_schema=json.dumps(schema), max_new_tokens=32)
            check = ("json", key)
        elif kind == "choice":
            choices = ["red", "green", "blue", f"c{i}x"]
            sp.update(choice=choices, max_new_tokens=8)
            check = ("choice", choices)
        elif kind == "ebnf":
            sp.update(ebnf=f'root ::= ("yes" | "no" | "e{i}q") "-" [0-9]', max_new_tokens=16)
            check = ("regex", rf"(yes|no|e{i}q)-[0-9]")
        body = {"text": PROMPTS[i % len(PROMPTS)], "rid": _rid(f"{tag}-{kind}-{i}"),
                "sampling_params": sp, "stream": i % 5 == 2}
        out.append((body, kind, check))
    return out


def _check_output(out: dict, check) -> None:
    fr = out["meta_info"]["finish_reason"]
    text = out["text"]
    if check is None:
        assert fr["type"] in ("stop", "length"), out
        return
    assert fr["type"] == "stop", f"bounded grammar did not finish: {out}"
    what, arg = check
    if what == "regex":
        assert re.fullmatch(arg, text), f"{text!r} does not match {arg!r}"
    elif what == "choice":
        assert text in arg, f"{text!r} not one of {arg}"
    elif what == "json":
        value = json.loads(text)
        assert list(value) == [arg] and value[arg] in ("x", "y", "z"), text


# ---- tests -----------------------------------------------------------------------------
@pytest.mark.timeout(330)  # includes starting the module's server (~20-40 s, up to 150 s)
def test_lock_step_under_compile_skew(skew_server):
    """56 mixed requests, 12 in flight, while rank 1 compiles every grammar 0-300 ms later
    than rank 0 (and two grammars 1 s later on rank 0): all complete with valid outputs and
    both ranks run exactly the same batches."""
    client, logs, skew_logs, ranks = skew_server
    skew_lines = [len(_read_log(skew_logs / f"rankskew_rank{r}.log")) for r in (0, 1)]
    reqs = _mixed_requests(56)
    slow0 = [f"(SLOWRANK0x{i}{uuid.uuid4().hex[:4]}|[0-9]{{2}})" for i in (0, 1)]
    for i, regex in enumerate(slow0):  # ready on rank 1 long before rank 0
        reqs.append((_regex_body(_rid(f"t1-slow0-{i}"), regex), "regex", ("regex", regex)))
    results = _send_all(client, [b for b, _, _ in reqs])
    for (body, kind, check), (status, out) in zip(reqs, results):
        assert status == 200, (body, out)
        assert out["meta_info"]["id"] == body["rid"]
        _check_output(out, check)
    _assert_settled(client)

    batches = _identical_batch_logs(logs, ranks=ranks)
    # Seeded and greedy sampling already agree across ranks: the agreement ran and no
    # rank's own sample differed (measured here, over every constrained step).
    agreed = _agreement_steps(logs, ranks[0])
    print(f"token agreement ran on {agreed} of {len(batches)} batches, 0 mismatches")
    assert agreed > 0
    logged = _logged_rids(batches)
    missing = [out["meta_info"]["id"] for _, out in results if out["meta_info"]["id"] not in logged]
    assert not missing, f"requests answered but never batched: {missing}"
    constrained = {b["rid"] for b, kind, _ in reqs if kind != "plain"}
    with_grammar = [(mode, rids) for _, mode, rids in batches if constrained & set(rids)]
    # Grammars in every kind of batch, MIXED ones (a prefill beside decode rows) included.
    # (EXTEND only while nothing runs, which this load rarely leaves.)
    assert {"DECODE", "MIXED"} <= {mode for mode, _ in with_grammar}, with_grammar
    assert any(set(rids) - constrained for _, rids in with_grammar), \
        "no batch mixed constrained and unconstrained requests"

    # Grammar fast-forward (on by default) forced tokens, identically on both ranks (the
    # FORCED lines are part of the identical logs), and the responses say how many.
    forced = [ln for ln in _read_log(logs / f"batches_{ranks[0]}.log") if " FORCED " in ln]
    reported = sum(out["meta_info"]["fast_forward_tokens"] for _, out in results)
    assert forced and reported > 0, (len(forced), reported)

    # The skew was real: both ranks compiled every spec, rank 1 often well after rank 0.
    done = []
    for r in (0, 1):
        lines = [ln.split() for ln in _read_log(skew_logs / f"rankskew_rank{r}.log")[skew_lines[r]:]]
        done.append({digest: float(t) for t, _, outcome, digest in lines if outcome == "ok"})
    assert len(done[0]) == len(constrained) and done[0].keys() == done[1].keys()
    later = sum(done[1][k] - done[0][k] > 0.05 for k in done[0])
    assert later >= 5, f"rank 1 finished only {later} compiles >50 ms after rank 0: no real skew"
    # The SLOWRANK0 specs: rank 0 slept 1 s more than rank 1 could, so rank 1's verdict
    # came first. (Not by a fixed margin: rank 1's compile threads may queue the spec behind
    # its own 0-300 ms skews, which measured up to ~0.5 s on a busy 2-core CI machine.)
    slept0 = {digest: float(ms) for _, ms, outcome, digest in
              (ln.split() for ln in _read_log(skew_logs / "rankskew_rank0.log")[skew_lines[0]:])
              if outcome == "ok"}
    for regex in slow0:
        k = hashlib.sha1(regex.encode()).hexdigest()[:12]
        assert slept0[k] >= 1000.0, (regex, slept0[k])
        assert done[0][k] - done[1][k] > 0.1, f"{regex} did not finish on rank 1 first"


@pytest.mark.timeout(120)
def test_compile_fails_on_one_rank_only(skew_server):
    """FAILONRANK1 compiles on rank 0 and raises on rank 1: the union of failures wins, the
    request is a 400 with rank 1's reason, never batched on either rank, concurrent
    requests complete, and the agreed failure is cached on both ranks (a resend is the
    same 400)."""
    client, logs, _, ranks = skew_server
    nonce = uuid.uuid4().hex[:6]
    failing = [  # (rid, kind, spec, stream)
        (_rid("t2-fail-regex"), "regex", f"(FAILONRANK1|[a-z]{{3}}|f{nonce})", False),
        # the same spec concurrently: shares the in-flight compile (or hits the cached failure)
        (_rid("t2-fail-regex-dup"), "regex", f"(FAILONRANK1|[a-z]{{3}}|f{nonce})", False),
        # rank 0 is the slow one here: rank 1's failure is known while rank 0 still compiles
        (_rid("t2-fail-slow0"), "regex", f"(FAILONRANK1SLOWRANK0|[0-9]{{2}}|f{nonce})", False),
        (_rid("t2-fail-json"), "json_schema", json.dumps(
            {"type": "object", "description": f"FAILONRANK1 {nonce}",
             "properties": {"a": {"type": "integer"}}, "required": ["a"]}), False),
        (_rid("t2-fail-ebnf-stream"), "ebnf", f'root ::= "FAILONRANK1" | "s{nonce}" [0-9]', True),
    ]
    bodies = [{"text": "Write a number:", "rid": rid, "stream": stream,
               "sampling_params": {kind: spec, "max_new_tokens": 16, "temperature": 0}}
              for rid, kind, spec, stream in failing]
    normal = _mixed_requests(10, start=100, tag="t2")
    results = _send_all(client, bodies + [b for b, _, _ in normal])

    def assert_failed(body, kind, status, out):
        expected = f"Failed to compile {kind} grammar: {INJECTED}"
        if body["stream"]:  # the stream has begun (200): its last chunk carries the abort
            assert status == 200 and out["meta_info"]["finish_reason"] == {
                "type": "abort", "message": expected, "status_code": 400}, out
        else:
            assert status == 400 and out["error"]["message"] == expected, (body, out)

    for (_, kind, _, _), body, (status, out) in zip(failing, bodies, results):
        assert_failed(body, kind, status, out)
    for (body, _, check), (status, out) in zip(normal, results[len(bodies):]):
        assert status == 200, (body, out)
        _check_output(out, check)
    # The agreed failure is in both ranks' negative cache: the same spec fails again.
    again = [dict(b, rid=b["rid"] + "-again") for b in bodies]
    for (_, kind, _, _), body, (status, out) in zip(failing, again, _send_all(client, again)):
        assert_failed(body, kind, status, out)
    _assert_settled(client)

    logged = _logged_rids(_identical_batch_logs(logs, ranks=ranks))
    assert not {b["rid"] for b in bodies + again} & logged, "a failed request was batched"
    assert {b["rid"] for b, _, _ in normal} <= logged


@pytest.mark.timeout(120)
def test_compile_exceeds_poll_budget_on_one_rank_only(skew_server):
    """HANGONRANK1 compiles on rank 0 but blocks on rank 1 past SGLANG_GRAMMAR_MAX_POLL_ITERATIONS:
    a 400 with the timeout message (for both requests sharing the spec), a third one that
    the client abandons meanwhile is aborted on both ranks, other requests complete,
    nothing hangs. The timeout is not cached: once rank 1 can compile the spec,
    it is served."""
    client, logs, _, ranks = skew_server
    hang_regex = f"(HANGONRANK1|[0-9]{{3}}|h{uuid.uuid4().hex[:6]})"
    hangs = [_regex_body(_rid("t3-hang"), hang_regex), _regex_body(_rid("t3-hang-dup"), hang_regex)]
    normal = _mixed_requests(8, start=200, tag="t3")

    abandoned = _regex_body(_rid("t3-hang-abandoned"), hang_regex)
    aborted_before = client.get("/get_server_info").json()["num_aborted_requests"]

    def timed(body):
        start = time.monotonic()
        return (*_send(client, body), time.monotonic() - start)

    def abandon(body):  # the client gives up while the grammar is still queued: an abort
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=body, timeout=1.0)

    with ThreadPoolExecutor(12) as pool:
        gone = pool.submit(abandon, abandoned)
        results = list(pool.map(timed, hangs + [b for b, _, _ in normal]))
        gone.result()
    for body, (status, out, elapsed) in zip(hangs, results):
        assert status == 400 and out["error"]["message"] == TIMEOUT_MESSAGE, (body, out)
        assert elapsed < 60, f"the timed-out request took {elapsed:.1f} s"
    for (body, _, check), (status, out, _) in zip(normal, results[len(hangs):]):
        assert status == 200, (body, out)
        _check_output(out, check)

    # Unblock rank 1's compile thread; then the same spec compiles on both ranks.
    release = r"(RELEASEHANG|[0-9]{2})"
    status, out = _send(client, _regex_body(_rid("t3-release"), release))
    assert status == 200 and re.fullmatch(release, out["text"]), out
    retry = _regex_body(_rid("t3-retry"), hang_regex)
    status, out = _send(client, retry)
    assert status == 200 and re.fullmatch(hang_regex, out["text"]), out
    _assert_settled(client)
    assert client.get("/get_server_info").json()["num_aborted_requests"] == aborted_before + 1

    logged = _logged_rids(_identical_batch_logs(logs, ranks=ranks))
    assert not {b["rid"] for b in hangs + [abandoned]} & logged, "a timed-out or aborted request was batched"
    assert {b["rid"] for b, _, _ in normal} | {retry["rid"]} <= logged
