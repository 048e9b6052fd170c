"""Request storms against a dedicated REAL server (``python launch.py``, the suite's tiny model on
CPU, module-scoped ``storm_server``: --enable-metrics, small budgets: --max-running-requests
STORM_MAX_RUNNING, --max-queued-requests STORM_MAX_QUEUED), all traffic on 127.0.0.1:

1. ``test_concurrent_storm``: STORM_SIZE requests at once, each on its own connection, a
   mix of unconstrained and constrained (json_schema / regex / choice through /generate,
   /v1/completions and /v1/chat/completions, OpenAI's response_format and vLLM's
   guided_* / structured_outputs), streaming and not, a few tokens each. Every request gets
   exactly one well-formed answer: a complete generation (finish reason stop / length,
   the constraint honoured where it finished) or a clean 503 "queue is full" (past
   --max-queued-requests); native rids come back unchanged, response ids are unique; the
   server's own counters (sglang:num_requests_total, sglang:generation_tokens_total) grow
   by exactly what the clients received.
2. ``test_mid_stream_disconnects``: N_DISCONNECTS streams (long, ignore_eos) each read for
   zero (right after the headers), one or two events, then the connection is closed. The server must abort every one of
   them (sglang:num_aborted_requests_total grows by N_DISCONNECTS) and free their KV.
3. ``test_client_that_never_reads``: a raw socket with a tiny SO_RCVBUF opens a long stream
   and never reads it; other requests keep being answered meanwhile; then it disconnects,
   and the request is aborted and its KV freed long before it could have finished.

After each storm (``_assert_idle_and_intact``): nothing in flight, nothing running or
queued, the KV pool back to 0 used tokens of max_total_num_tokens (/metrics
sglang:num_used_tokens = total - free slots - evictable prefix cache; besides, an idle
scheduler checks free + cached == total, nothing locked and every request row free on
every loop, and exits with "KV cache leak" otherwise, so /health would be 503), and a
normal request right after is answered. Bounded: each storm has a fixed count and a time limit (STORM_TIMEOUT_S).
Run with ``-s`` to see the counts and times.
"""
from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import struct
import time
from typing import Any, Optional

import httpx
import pytest

from conftest import _launch_server

pytestmark = pytest.mark.timeout(240)

STORM_SIZE = 200
N_DISCONNECTS = 100
DISCONNECT_CONCURRENCY = 50
STORM_MAX_RUNNING = 32
STORM_MAX_QUEUED = 150  # under STORM_SIZE: some requests may get the 503 (both are fine)
STORM_TIMEOUT_S = 120.0  # one storm, all its requests
IDLE_TIMEOUT_S = 30.0  # after a storm: nothing running and the KV pool empty within this
MAX_TOKENS = 4
JSON_MAX_TOKENS = 10  # {"a": 123} and its stop
N_SERVED_WHILE_STUCK = 4

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
REGEX = r"[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def storm_server(tmp_path_factory, tiny_dir):
    yield from _launch_server(tmp_path_factory, tiny_dir, [
        "--enable-metrics", "--max-running-requests", str(STORM_MAX_RUNNING),
        "--max-queued-requests", str(STORM_MAX_QUEUED), "--grammar-backend", "xgrammar"])


# ---- server state ------------------------------------------------------------------------
def _metrics(base: str) -> dict[str, float]:
    """The unlabelled-by-us samples of /metrics: name -> value (one DP group, one model)."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name.split("{")[0]] = float(value)
    return out


def _server_info(base: str) -> dict:
    return httpx.get(base + "/get_server_info", timeout=10).json()


def _kv_figures(base: str) -> dict[str, Any]:
    m, info = _metrics(base), _server_info(base)
    total = int(m.get("sglang:max_total_num_tokens", -1))
    used = int(m.get("sglang:num_used_tokens", -1))
    # used = total - (free slots + evictable prefix cache): the scheduler's own figures.
    return {"total": total, "used": used, "available": total - used, "pool": info["max_total_num_tokens"],
            "running": int(m.get("sglang:num_running_reqs", -1)), "queued": int(m.get("sglang:num_queue_reqs", -1)),
            "inflight": info["num_inflight_requests"]}


def _assert_idle_and_intact(base: str, what: str) -> dict[str, Any]:
    """Nothing in flight, running or queued; every KV slot free (or evictable cache); the
    server answers a normal request. Returns the KV figures."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        kv = _kv_figures(base)
        if kv["inflight"] == kv["running"] == kv["queued"] == kv["used"] == 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"after {what}: not idle {IDLE_TIMEOUT_S:.0f} s later (a leaked request or KV): {kv}")
        time.sleep(0.25)
    assert kv["total"] == kv["pool"] > 0, kv
    # Idle, the scheduler checks free + cached == total, nothing locked, every request row
    # free, on every loop; a leak raises "KV cache leak" and the scheduler exits: /health 503.
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code == 200, f"after {what}: /health {r.status_code} {r.text}"
    r = httpx.post(base + "/generate", timeout=60, json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
    return kv


# ---- the 200-request storm -----------------------------------------------------------------
def _storm_requests() -> list[dict]:
    """(path, body, check) for each request: kinds in turn (deterministic)."""
    chat_msgs = [{"role": "user", "content": "Give me a number."}]
    kinds = [
        ("/generate", lambda i: {"text": f"Storm request {i}:", "sampling_params": {"max_new_tokens": MAX_TOKENS}}, None),
        ("/generate", lambda i: {"text": "Fill in JSON:", "sampling_params": {
            "max_new_tokens": JSON_MAX_TOKENS, "temperature": 0, "json_schema": json.dumps(SCHEMA)}}, "json"),
        ("/generate", lambda i: {"text": "My number is ", "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "regex": REGEX}}, "regex"),
        ("/generate", lambda i: {"text": "Answer:", "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "choice": CHOICES}}, "choice"),
        ("/v1/completions", lambda i: {"model": "smollm2", "prompt": f"Count {i}", "max_tokens": MAX_TOKENS}, None),
        ("/v1/completions", lambda i: {"model": "smollm2", "prompt": "Number: ", "max_tokens": MAX_TOKENS,
                                       "regex": REGEX}, "regex"),
        ("/v1/completions", lambda i: {"model": "smollm2", "prompt": "Pick:", "max_tokens": MAX_TOKENS,
                                       "guided_choice": CHOICES}, "choice"),
        ("/v1/chat/completions", lambda i: {"model": "smollm2", "messages": chat_msgs, "max_tokens": MAX_TOKENS}, None),
        ("/v1/chat/completions", lambda i: {"model": "smollm2", "messages": chat_msgs, "max_tokens": JSON_MAX_TOKENS,
                                            "temperature": 0, "response_format": {
                                                "type": "json_schema",
                                                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         "json"),
        ("/v1/chat/completions", lambda i: {"model": "smollm2", "messages": chat_msgs, "max_tokens": MAX_TOKENS,
                                            "structured_outputs": {"regex": REGEX}}, "regex"),
        ("/v1/chat/completions", lambda i: {"model": "smollm2", "messages": chat_msgs, "max_tokens": MAX_TOKENS,
                                            "choice": CHOICES}, "choice"),
    ]
    reqs = []
    for i in range(STORM_SIZE):
        path, make, check = kinds[i % len(kinds)]
        body = make(i)
        if path == "/generate":
            body["rid"] = f"storm-{i}"
        stream = i % 3 == 0
        if stream:
            body["stream"] = True
            if path != "/generate":
                body["stream_options"] = {"include_usage": True}
        reqs.append({"i": i, "path": path, "body": body, "check": check, "stream": stream})
    return reqs


QUEUE_FULL = re.compile(r"queue is full", re.I)


def _check_constraint(check: Optional[str], text: str, finish: str) -> Optional[str]:
    if check is None or finish != "stop":  # a constraint cut short by max tokens is a prefix
        return None
    if check == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return f"not JSON: {text!r}"
        return None if isinstance(obj, dict) and isinstance(obj.get("a"), int) and list(obj) == ["a"] else f"schema: {text!r}"
    if check == "regex":
        return None if re.fullmatch(REGEX, text) else f"regex: {text!r}"
    return None if text in CHOICES else f"choice: {text!r}"


def _parse_answer(req: dict, status: int, content_type: str, body: bytes) -> dict:
    """-> {"outcome": "ok" | "503", "id": ..., "tokens": n} or {"outcome": "bad", "why": ...}."""
    path, check = req["path"], req["check"]

    def bad(why: str) -> dict:
        return {"outcome": "bad", "why": f"{why} <- {path} {json.dumps(req['body'])[:200]}: {body[-300:]!r}"}

    if status == 503 or (status >= 400 and not req["stream"]):
        try:
            msg = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return bad(f"HTTP {status} without an error message")
        return {"outcome": "503"} if status == 503 and QUEUE_FULL.search(msg) else bad(f"HTTP {status}: {msg}")
    if status != 200:
        return bad(f"HTTP {status}")
    if not req["stream"]:
        try:
            data = json.loads(body)
        except ValueError:
            return bad("200 body is not JSON")
        if path == "/generate":
            meta = data["meta_info"]
            text, finish, rid, tokens = data["text"], meta["finish_reason"]["type"], meta["id"], meta["completion_tokens"]
        else:
            choice = data["choices"][0]
            text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
            finish, rid, tokens = choice["finish_reason"], data["id"], data["usage"]["completion_tokens"]
    else:
        text_parts, finish, rid, tokens, error = [], None, None, None, None
        events = [e for e in body.decode("utf-8", "replace").split("\n\n") if e.strip()]
        if not events or events[-1] != "data: [DONE]" or events.count("data: [DONE]") != 1:
            return bad("stream does not end with exactly one data: [DONE]")
        for ev in events[:-1]:
            if not ev.startswith("data: "):
                return bad(f"SSE event without data: {ev[:100]!r}")
            data = json.loads(ev[6:])
            if "error" in data:
                error = data["error"]
                continue
            if error is not None:
                return bad("events after an error event")
            if path == "/generate":
                meta = data["meta_info"]
                rid, text_parts = meta["id"], [data["text"]]  # cumulative text
                if meta["finish_reason"] is not None:
                    if finish is not None:
                        return bad("two finish events")
                    finish, tokens = meta["finish_reason"]["type"], meta["completion_tokens"]
                    if finish == "abort":
                        error = {"message": meta["finish_reason"].get("message", ""),
                                 "code": meta["finish_reason"].get("status_code")}
            else:
                rid = data["id"]
                if data.get("usage") and not data["choices"]:
                    tokens = data["usage"]["completion_tokens"]
                for c in data["choices"]:
                    piece = c["text"] if path == "/v1/completions" else c["delta"].get("content")
                    text_parts.append(piece or "")
                    if c["finish_reason"] is not None:
                        if finish is not None:
                            return bad("two finish events")
                        finish = c["finish_reason"]
        if error is not None:
            code = error.get("code")
            if code == 503 and QUEUE_FULL.search(error.get("message") or ""):
                return {"outcome": "503"}
            return bad(f"stream error {error}")
        text = "".join(text_parts)
    if finish not in ("stop", "length"):
        return bad(f"finish reason {finish!r}")
    if not isinstance(tokens, int) or not 0 < tokens <= JSON_MAX_TOKENS:
        return bad(f"{tokens!r} completion tokens")
    if path == "/generate" and rid != req["body"]["rid"]:
        return bad(f"rid {rid!r} came back for {req['body']['rid']!r}")
    why = _check_constraint(check, text, finish)
    if why:
        return bad(f"constraint not honoured ({why})")
    return {"outcome": "ok", "id": rid, "tokens": tokens}


async def _one(client: httpx.AsyncClient, req: dict, start: asyncio.Event) -> dict:
    await start.wait()
    try:
        async with client.stream("POST", req["path"], json=req["body"]) as r:
            body = await r.aread()
            return _parse_answer(req, r.status_code, r.headers.get("content-type", ""), body)
    except httpx.HTTPError as e:
        return {"outcome": "bad", "why": f"no answer: {type(e).__name__}: {e} <- {req['path']}"}


async def _storm(base: str, reqs: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(reqs) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=STORM_TIMEOUT_S, limits=limits) as client:
        start = asyncio.Event()
        tasks = [asyncio.create_task(_one(client, r, start)) for r in reqs]
        await asyncio.sleep(0.05)
        start.set()  # all at once: each task opens its own connection
        return await asyncio.wait_for(asyncio.gather(*tasks), STORM_TIMEOUT_S)


def test_concurrent_storm(storm_server):
    base = storm_server
    before = _metrics(base)
    reqs = _storm_requests()
    t0 = time.perf_counter()
    results = asyncio.run(_storm(base, reqs))
    elapsed = time.perf_counter() - t0
    bad = [r["why"] for r in results if r["outcome"] == "bad"]
    assert not bad, f"{len(bad)} of {len(reqs)} requests without a well-formed answer:\n  " + "\n  ".join(bad[:20])
    outcomes = collections.Counter(r["outcome"] for r in results)
    ok = [r for r in results if r["outcome"] == "ok"]
    ids = [r["id"] for r in ok]
    assert len(ids) == len(set(ids)), "duplicate response ids: " + str([k for k, v in collections.Counter(ids).items() if v > 1])
    assert outcomes["ok"] + outcomes["503"] == STORM_SIZE and outcomes["ok"] > 0, outcomes
    kv = _assert_idle_and_intact(base, "the concurrent storm")
    after = _metrics(base)
    # The server's own counters: one finished request per answer, the tokens the clients got.
    n_done = after["sglang:num_requests_total"] - before.get("sglang:num_requests_total", 0) - 1  # -1: the check request
    gen = after["sglang:generation_tokens_total"] - before.get("sglang:generation_tokens_total", 0) - 4
    print(f"\nstorm: {STORM_SIZE} concurrent requests in {elapsed:.1f} s: {dict(outcomes)}; server counted "
          f"{n_done:.0f} finished requests, {gen:.0f} generated tokens (clients got {sum(r['tokens'] for r in ok)}); "
          f"KV after: {kv}")
    assert n_done == STORM_SIZE, f"the server finished {n_done:.0f} requests for {STORM_SIZE} sent ({dict(outcomes)})"
    assert gen == sum(r["tokens"] for r in ok)


# ---- 100 mid-stream disconnects ---------------------------------------------------------
def _ended(event: dict) -> bool:
    """An error event, or a finish reason set (native: meta_info; OpenAI: a choice). The parsed
    event, not its text: the model may well generate the word "error"."""
    if "error" in event or (event.get("meta_info") or {}).get("finish_reason"):
        return True
    return any(c.get("finish_reason") for c in event.get("choices") or [])


async def _disconnect_one(client: httpx.AsyncClient, i: int, sem: asyncio.Semaphore) -> Optional[str]:
    path = ("/generate", "/v1/chat/completions", "/v1/completions")[i % 3]
    n_events = (i // 3) % 3  # 0: gone right after the headers (often still queued or prefilling)
    if path == "/generate":
        body = {"text": f"Tell a long story {i}.", "stream": True, "rid": f"cut-{i}",
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    elif path == "/v1/completions":
        body = {"model": "smollm2", "prompt": f"Tell a long story {i}.", "stream": True, "max_tokens": 400,
                "ignore_eos": True, **({"regex": "[a-z ]+"} if i % 4 == 0 else {})}
    else:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Tell a long story {i}."}],
                "stream": True, "max_tokens": 400, "ignore_eos": True}
    async with sem:
        try:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return f"{path}: HTTP {r.status_code}"
                seen = 0
                if n_events == 0:
                    return None
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if _ended(json.loads(line[len("data: "):])):
                            return f"{path}: ended before the client hung up: {line[:200]}"
                        seen += 1
                        if seen == n_events:
                            break  # leaving the block closes the connection mid-stream
                return None if seen == n_events else f"{path}: stream ended after {seen} events"
        except httpx.HTTPError as e:
            return f"{path}: {type(e).__name__}: {e}"


async def _disconnects(base: str) -> list[Optional[str]]:
    limits = httpx.Limits(max_connections=DISCONNECT_CONCURRENCY + 5, max_keepalive_connections=0)
    sem = asyncio.Semaphore(DISCONNECT_CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(_disconnect_one(client, i, sem) for i in range(N_DISCONNECTS))), STORM_TIMEOUT_S)


def test_mid_stream_disconnects(storm_server):
    base = storm_server
    before, info_before = _metrics(base), _server_info(base)
    t0 = time.perf_counter()
    errors = [e for e in asyncio.run(_disconnects(base)) if e]
    elapsed = time.perf_counter() - t0
    assert not errors, f"{len(errors)} streams misbehaved: {errors[:10]}"
    t1 = time.perf_counter()
    kv = _assert_idle_and_intact(base, f"{N_DISCONNECTS} mid-stream disconnects")
    settle = time.perf_counter() - t1
    after, info_after = _metrics(base), _server_info(base)
    aborted = after["sglang:num_aborted_requests_total"] - before.get("sglang:num_aborted_requests_total", 0)
    frontend_aborted = info_after["num_aborted_requests"] - info_before["num_aborted_requests"]
    print(f"\ndisconnects: {N_DISCONNECTS} streams cut after 0-2 events in {elapsed:.1f} s "
          f"({DISCONNECT_CONCURRENCY} at a time); idle {settle:.1f} s later; aborted {aborted:.0f} "
          f"(frontend {frontend_aborted}); KV after: {kv}")
    # Every one was aborted (none ran to its 400 tokens: the idle check would have timed out).
    assert aborted == N_DISCONNECTS and frontend_aborted == N_DISCONNECTS, (aborted, frontend_aborted)
    assert after["sglang:num_requests_total"] - before.get("sglang:num_requests_total", 0) == 1  # the check only


# ---- a client that never reads -----------------------------------------------------------
def _open_unread_stream(port: int, body: dict) -> socket.socket:
    """A streaming request on a socket with a tiny receive buffer that is never read."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays small
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _server_send_queue(server_port: int, client_port: int) -> Optional[int]:
    """Bytes the server has written to the client's connection that the client's window
    did not take yet (Linux /proc/net/tcp tx_queue of the server's socket); None if unknown."""
    want_local, want_remote = f":{server_port:04X}", f":{client_port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[1].endswith(want_local) and parts[2].endswith(want_remote):
                    return int(parts[4].split(":")[0], 16)
    except OSError:
        pass
    return None


def test_client_that_never_reads(storm_server):
    base = storm_server
    port = int(base.rsplit(":", 1)[1])
    before = _metrics(base)
    rid = "never-reads"
    # Logprobs make every event larger than the last (they are cumulative): the client's
    # window and the server's socket buffer fill after a few tokens.
    sock = _open_unread_stream(port, {"text": "Write a very long essay about the sea.", "stream": True, "rid": rid,
                                      "return_logprob": True, "top_logprobs_num": 20, "return_text_in_logprobs": True,
                                      "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    client_port = sock.getsockname()[1]
    try:
        deadline = time.monotonic() + 30
        while not (_server_send_queue(port, client_port) or 0) > 0:  # the server's writes back up
            assert time.monotonic() < deadline, "the unread stream never backed up"
            time.sleep(0.1)
        t0 = time.perf_counter()
        served = []
        with httpx.Client(base_url=base, timeout=30) as c:
            for i in range(N_SERVED_WHILE_STUCK):  # others keep being served while it is stuck
                t = time.perf_counter()
                r = c.post("/v1/chat/completions" if i % 2 else "/generate", json=(
                    {"model": "smollm2", "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4}
                    if i % 2 else {"text": f"Hello {i}", "sampling_params": {"max_new_tokens": 4, "regex": REGEX}}))
                assert r.status_code == 200, r.text
                served.append(time.perf_counter() - t)
                assert c.get("/health").status_code == 200
        info = _server_info(base)
        assert info["num_inflight_requests"] == 1, "the unread stream ended by itself (too short to test)"
        kv_stuck = _kv_figures(base)
        send_queue = _server_send_queue(port, client_port)
    finally:
        # Hang up with a reset (SO_LINGER 0): unread data in our buffer is dropped.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    t1 = time.perf_counter()
    kv = _assert_idle_and_intact(base, "the client that never read its stream")
    settle = time.perf_counter() - t1
    after = _metrics(base)
    aborted = after["sglang:num_aborted_requests_total"] - before.get("sglang:num_aborted_requests_total", 0)
    gen = after["sglang:generation_tokens_total"] - before.get("sglang:generation_tokens_total", 0)
    print(f"\nnever-reading client: {N_SERVED_WHILE_STUCK} other requests served meanwhile in "
          f"{t1 - t0:.1f} s (slowest {max(served):.1f} s); while stuck: server send queue {send_queue} bytes, "
          f"{kv_stuck}; idle {settle:.1f} s after the hang-up; aborted {aborted:.0f}; {gen:.0f} tokens "
          f"counted for the others and the check; KV after: {kv}")
    assert aborted == 1, aborted
