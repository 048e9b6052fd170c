"""TP=2 through the real server: ranks whose grammar compiles finish at different times
(tests/rank_skew_grammar_plugin.py) never disagree on what to run.

Every rank writes the batches it runs (GRAMSYNC_BATCH_LOG_DIR); the two ranks' logs must
be identical line for line, whatever the compile skew, a compile that fails on one rank
only, or a compile that exceeds the poll budget on one rank only.

One module-scoped TP=2 server serves all tests (~40 s to start on 2 cores).
"""
from __future__ import annotations

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
MAX_POLLS = 400  # ~2-3 s of idle polling; >> the 0-300 ms skew even when busy
REQUEST_TIMEOUT_S = 150
TIMEOUT_MESSAGE = (f"Grammar preprocessing timed out: the regex grammar was not compiled within "
                   f"{MAX_POLLS} scheduler polls (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS).")
INJECTED = "rankskew injected compile failure on rank 1"
PROMPTS = ["Write a number:", "Answer yes or no. Is the sky blue?", "Name a color:",
           "Say something short.", "Give me a word:", "The capital of France is"]


@pytest.fixture(scope="module")
def skew_server(tmp_path_factory, smollm2_dir):
    logs = tmp_path_factory.mktemp("batch_logs")
    skew_logs = tmp_path_factory.mktemp("skew_logs")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])),
           "GRAMSYNC_BATCH_LOG_DIR": str(logs), "RANKSKEW_LOG_DIR": str(skew_logs),
           "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS": str(MAX_POLLS)}
    args = ["--tp-size", "2", "--grammar-backend-plugins", "rank_skew_grammar_plugin",
            "--grammar-backend", "rankskew"]
    for base in _launch_server(tmp_path_factory, smollm2_dir, args, env):
        with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S,
                          limits=httpx.Limits(max_connections=32)) as client:
            yield client, logs, skew_logs


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


def _identical_batch_logs(log_dir, timeout: float = 15.0) -> list[tuple[int, str, list[str]]]:
    """Both ranks' batch logs, asserted identical and non-empty: [(step, mode, rids)].
    Waits briefly: a rank may still be writing its last line when the response arrives."""
    deadline = time.monotonic() + timeout
    while True:
        a = _read_log(log_dir / "batches_DP0_TP0.log")
        b = _read_log(log_dir / "batches_DP0_TP1.log")
        if (a == b and a) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert a, "rank 0 wrote no batches"
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pytest.fail(f"batch logs differ at line {i} (TP0 {len(a)} lines, TP1 {len(b)} lines):\n"
                    f"TP0: {a[i - 2:i + 3]}\nTP1: {b[i - 2:i + 3]}")
    batches = []
    for n, line in enumerate(a):
        step, mode, rids = line.split(" ", 2)
        assert int(step) == n, f"steps not consecutive at line {n}: {line}"
        assert mode in ("EXTEND", "DECODE"), line
        batches.append((int(step), mode, rids.split(",")))
    return batches


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
def _mixed_requests(n: int) -> list[tuple[dict, str, object]]:
    """(body, kind, check) for ``n`` requests: unconstrained, regex, json_schema, choice
    and ebnf, every spec unique (no cache hit skips a compile), some streamed, some sampled
    at temperature 0.8 with a seed, varied max_new_tokens."""
    kinds = ["plain", "regex", "json_schema", "choice", "ebnf", "regex", "plain", "json_schema"]
    out = []
    for i in range(n):
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
        body = {"text": PROMPTS[i % len(PROMPTS)], "rid": _rid(f"t1-{kind}-{i}"),
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
@pytest.mark.timeout(330)  # includes starting the module's server (~40 s, up to 150 s)
def test_lock_step_under_compile_skew(skew_server):
    client, logs, skew_logs = skew_server
    reqs = _mixed_requests(56)
    results = _send_all(client, [b for b, _, _ in reqs])
    for (body, kind, check), (status, out) in zip(reqs, results):
        assert status == 200, (body, out)
        assert out["meta_info"]["id"] == body["rid"]
        _check_output(out, check)
    _assert_settled(client)

    batches = _identical_batch_logs(logs)
    logged = _logged_rids(batches)
    missing = [out["meta_info"]["id"] for _, out in results if out["meta_info"]["id"] not in logged]
    assert not missing, f"requests answered but never batched: {missing}"
    constrained = {b["rid"] for b, kind, _ in reqs if kind != "plain"}
    with_grammar = [(mode, rids) for _, mode, rids in batches if constrained & set(rids)]
    assert {mode for mode, _ in with_grammar} == {"EXTEND", "DECODE"}, with_grammar
    assert any(set(rids) - constrained for _, rids in with_grammar), \
        "no batch mixed constrained and unconstrained requests"

    # The skew was real: rank 1 compiled every spec too, and often finished well after rank 0.
    done = []
    for r in (0, 1):
        lines = [ln.split() for ln in _read_log(skew_logs / f"rankskew_rank{r}.log")]
        done.append({digest: float(t) for t, _, outcome, digest in lines if outcome == "ok"})
    assert len(done[0]) >= len(constrained) and done[0].keys() == done[1].keys()
    later = sum(done[1][k] - done[0][k] > 0.05 for k in done[0])
    assert later >= 5, f"rank 1 finished only {later} compiles >50 ms after rank 0: no real skew"


@pytest.mark.timeout(120)
def test_compile_fails_on_one_rank_only(skew_server):
    """FAILONRANK1 compiles on rank 0 and raises on rank 1: the union of failures wins, the
    request is a 400 with rank 1's reason, never batched on either rank, and the agreed
    failure is cached identically (a resend is the same 400)."""
    client, logs, _ = skew_server
    failing = {  # rid -> (body, kind)
        _rid("t2-fail-regex"): ("regex", f"(FAILONRANK1|[a-z]{{3}}|f{uuid.uuid4().hex[:6]})"),
        # rank 0 is the slow one here: rank 1's failure is known first
        _rid("t2-fail-slow0"): ("regex", f"(FAILONRANK1SLOWRANK0|[0-9]{{2}}|f{uuid.uuid4().hex[:6]})"),
        _rid("t2-fail-json"): ("json_schema", json.dumps(
            {"type": "object", "description": f"FAILONRANK1 {uuid.uuid4().hex[:6]}",
             "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
    }
    bodies = [{"text": "Write a number:", "rid": rid,
               "sampling_params": {kind: spec, "max_new_tokens": 16, "temperature": 0}}
              for rid, (kind, spec) in failing.items()]
    normal = [b for b, _, _ in _mixed_requests(10)]
    for b in normal:
        b["rid"] = b["rid"].replace("t1-", "t2-")
    results = _send_all(client, bodies + normal)

    messages = {}
    for body, (status, out) in zip(bodies, results[:len(bodies)]):
        kind = failing[body["rid"]][0]
        assert status == 400, (body, out)
        message = out["error"]["message"]
        assert message == f"Failed to compile {kind} grammar: {INJECTED}", message
        messages[body["rid"]] = message
    for body, (status, out) in zip(normal, results[len(bodies):]):
        assert status == 200, (body, out)
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out
    # The agreed failure is in both ranks' negative cache: the same spec fails again, at once.
    again = [dict(b, rid=b["rid"] + "-again") for b in bodies]
    for body, (status, out) in zip(again, _send_all(client, again)):
        assert status == 400 and out["error"]["message"] == messages[body["rid"][:-len("-again")]], out
    _assert_settled(client)

    logged = _logged_rids(_identical_batch_logs(logs))
    assert not {b["rid"] for b in bodies + again} & logged, "a failed request was batched"
    assert {b["rid"] for b in normal} <= logged


@pytest.mark.timeout(120)
def test_compile_exceeds_poll_budget_on_one_rank_only(skew_server):
    """HANGONRANK1 compiles on rank 0 but blocks on rank 1 past SGLANG_GRAMMAR_MAX_POLL_ITERATIONS:
    a 400 with the timeout message, other requests complete, nothing hangs. The timeout is
    not cached: once rank 1 can compile it, the same spec is served."""
    client, logs, _ = skew_server
    hang_regex = f"(HANGONRANK1|[0-9]{{3}}|h{uuid.uuid4().hex[:6]})"
    hang = _regex_body(_rid("t3-hang"), hang_regex)
    normal = [b for b, _, _ in _mixed_requests(8)]
    for b in normal:
        b["rid"] = b["rid"].replace("t1-", "t3-")
    start = time.monotonic()
    results = _send_all(client, [hang] + normal)
    elapsed = time.monotonic() - start
    status, out = results[0]
    assert status == 400, out
    assert out["error"]["message"] == TIMEOUT_MESSAGE
    assert elapsed < 60, f"the timed-out request took {elapsed:.1f} s"
    for body, (status, out) in zip(normal, results[1:]):
        assert status == 200, (body, out)
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out

    # Unblock rank 1's compile thread; then the same spec compiles on both ranks.
    status, out = _send(client, _regex_body(_rid("t3-release"), f"(RELEASEHANG|[0-9]{{2}})"))
    assert status == 200 and re.fullmatch(r"(RELEASEHANG|[0-9]{2})", out["text"]), out
    retry = _regex_body(_rid("t3-retry"), hang_regex)
    status, out = _send(client, retry)
    assert status == 200, out
    assert re.fullmatch(hang_regex, out["text"]), out
    _assert_settled(client)

    logged = _logged_rids(_identical_batch_logs(logs))
    assert hang["rid"] not in logged, "the timed-out request was batched"
    assert {b["rid"] for b in normal} | {retry["rid"]} <= logged
