"""HTTP security end to end, through REAL servers (`python launch.py`, the suite's tiny model on
CPU): API keys (flag and $GRAMSYNC_API_KEY), the admin key, --max-request-bytes (announced
and chunked bodies), a huge prompt that must neither stall other requests nor be tokenized,
and schema ``$ref``s that must never be fetched.

Two servers for the whole module (each takes ~10-20 s to start):

* ``keyed``: ``--api-key sk-test --admin-api-key adm-test --max-request-bytes 1048576``
  (keys, admin, body limit, $ref);
* ``env_keyed``: only ``GRAMSYNC_API_KEY=env-key`` in its environment and the default
  body limit (32 MiB), so it shows that the env var works and takes the 20 MB prompt.
"""
from __future__ import annotations

import http.server
import json
import statistics
import threading
import time
import uuid

import httpx
import openai
import pytest

from conftest import _launch_server

pytestmark = pytest.mark.timeout(300)  # fixture setup (a server start) counts too

API_KEY, ADMIN_KEY, ENV_KEY = "sk-test", "adm-test", "env-key"
LIMIT = 1 << 20  # --max-request-bytes of the keyed server
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ENV = {"Authorization": f"Bearer {ENV_KEY}"}
SMALL = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
MESSAGES = [{"role": "user", "content": "Say hi."}]
TIMEOUT = 60


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_dir):
    yield from _launch_server(tmp_path_factory, tiny_dir, [
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--max-request-bytes", str(LIMIT)])


@pytest.fixture(scope="module")
def env_keyed(tmp_path_factory, tiny_dir):
    # The admin key env var is cleared so that a value in the test's own environment
    # cannot leak in: without an admin key, the API key guards the admin endpoints.
    yield from _launch_server(tmp_path_factory, tiny_dir, [],
                              env={"GRAMSYNC_API_KEY": ENV_KEY, "GRAMSYNC_ADMIN_API_KEY": ""})


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


# ---- 1. API key -------------------------------------------------------------------------
ENDPOINTS = [
    ("POST", "/generate", SMALL),
    ("POST", "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": 0}),
    ("POST", "/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "max_tokens": 2,
                                      "temperature": 0}),
    ("GET", "/v1/models", None),
    ("GET", "/health_generate", None),
]


def test_api_key_required_on_every_endpoint(keyed):
    with httpx.Client(base_url=keyed, timeout=TIMEOUT) as c:
        for method, path, body in ENDPOINTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Authorization": f"Basic {API_KEY}"}):
                r = c.request(method, path, json=body, headers=headers)
                err = _assert_openai_error(r, 401)
                assert err["code"] == "invalid_api_key", (path, headers, err)
                assert r.headers.get("www-authenticate") == "Bearer"
            r = c.request(method, path, json=body, headers=USER)
            assert r.status_code == 200, (path, r.text)
        # /health is open (load balancers probe it without a key)
        assert c.get("/health").status_code == 200


def test_admin_key_also_admits_user_endpoints(keyed):
    r = httpx.post(keyed + "/generate", json=SMALL, headers=ADMIN, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_openai_client_with_key(keyed):
    client = openai.OpenAI(base_url=keyed + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content
    cmpl = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=3, temperature=0)
    assert cmpl.usage.completion_tokens == 3 and cmpl.choices[0].text
    assert [m.id for m in client.models.list().data] == ["smollm2"]

    wrong = openai.OpenAI(base_url=keyed + "/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="smollm2", prompt="Hi", max_tokens=3)


def test_api_key_from_env(env_keyed):
    with httpx.Client(base_url=env_keyed, timeout=TIMEOUT) as c:
        _assert_openai_error(c.post("/generate", json=SMALL), 401)
        _assert_openai_error(c.post("/generate", json=SMALL, headers=USER), 401)
        r = c.post("/generate", json=SMALL, headers=ENV)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
        assert c.get("/health").status_code == 200
        # No admin key: the API key guards the admin endpoints, and is never echoed.
        _assert_openai_error(c.get("/get_server_info"), 401)
        r = c.get("/get_server_info", headers=ENV)
        assert r.status_code == 200
        assert ENV_KEY not in r.text


# ---- 2. Admin endpoints -----------------------------------------------------------------
def test_admin_endpoints_need_the_admin_key(keyed):
    with httpx.Client(base_url=keyed, timeout=TIMEOUT) as c:
        for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
            _assert_openai_error(c.get("/get_server_info", headers=headers), 401)
            _assert_openai_error(c.post("/abort_request", json={"rid": "x"}, headers=headers), 401)
        r = c.get("/get_server_info", headers=ADMIN)
        assert r.status_code == 200
        info = r.json()
        assert "num_inflight_requests" in info
        assert API_KEY not in r.text and ADMIN_KEY not in r.text
        assert info["api_key"] == "<set>" and info["admin_api_key"] == "<set>"
        # admin key, unknown request id -> 404 (and the admin key got past the guard)
        err = _assert_openai_error(c.post("/abort_request", json={"rid": "no-such-rid"}, headers=ADMIN), 404)
        assert "no-such-rid" in err["message"]


def test_abort_request_ends_a_stream(keyed):
    rid = "abort-me-" + uuid.uuid4().hex
    body = {"text": "Write a very long essay about the sea.", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", keyed + "/generate", json=body, headers=USER, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln)
        assert first.startswith("data: ")
        # the user key does not grant the abort
        _assert_openai_error(httpx.post(keyed + "/abort_request", json={"rid": rid}, headers=USER,
                                        timeout=TIMEOUT), 401)
        a = httpx.post(keyed + "/abort_request", json={"rid": rid}, headers=ADMIN, timeout=TIMEOUT)
        assert a.status_code == 200, a.text
        assert a.json() == {"aborted": [rid]}
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] < 400
    # the request is gone: aborting it again is a 404
    _assert_openai_error(httpx.post(keyed + "/abort_request", json={"rid": rid}, headers=ADMIN,
                                    timeout=TIMEOUT), 404)


# ---- 3. Body limit ----------------------------------------------------------------------
def _oversized_generate_body() -> bytes:
    return json.dumps({"text": "a" * (LIMIT + 1000), "sampling_params": {"max_new_tokens": 1}}).encode()


def test_announced_body_over_limit_is_413(keyed):
    data = _oversized_generate_body()
    for path in ("/generate", "/v1/completions"):
        r = httpx.post(keyed + path, content=data, timeout=TIMEOUT,
                       headers={**USER, "Content-Type": "application/json"})
        err = _assert_openai_error(r, 413)
        assert str(LIMIT) in err["message"] and "--max-request-bytes" in err["message"]
    # the key is checked first: an unauthenticated oversized body is a 401
    r = httpx.post(keyed + "/generate", content=data, timeout=TIMEOUT,
                   headers={"Content-Type": "application/json"})
    _assert_openai_error(r, 401)
    r = httpx.post(keyed + "/generate", json=SMALL, headers=USER, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_chunked_body_over_limit_is_413(keyed):
    data = _oversized_generate_body()

    def chunks():  # a generator: httpx sends it chunked, without Content-Length
        for i in range(0, len(data), 64 * 1024):
            yield data[i:i + 64 * 1024]

    for path in ("/generate", "/v1/chat/completions"):
        r = httpx.post(keyed + path, content=chunks(), timeout=TIMEOUT,
                       headers={**USER, "Content-Type": "application/json"})
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert r.request.headers.get("transfer-encoding") == "chunked"
        err = _assert_openai_error(r, 413)
        assert "--max-request-bytes" in err["message"]
    # a chunked body under the limit is served
    small = json.dumps(SMALL).encode()
    r = httpx.post(keyed + "/generate", content=iter([small[:5], small[5:]]), timeout=TIMEOUT,
                   headers={**USER, "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    r = httpx.post(keyed + "/generate", json=SMALL, headers=USER, timeout=TIMEOUT)
    assert r.status_code == 200


# ---- 4. A huge prompt does not stall the others -----------------------------------------
BIG_CHARS = 20 * (1 << 20)  # 20 MiB of prompt (under the default 32 MiB body limit)


def _timed_small(c: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = c.post("/generate", json=SMALL)
    dt = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
    return dt


def _latency_round(base: str, big: bytes, rounds: int) -> dict:
    """``rounds`` x (one small request on an idle server, then one while a 20 MB prompt is
    in flight): idle and busy samples interleaved, so that load from outside (the machine
    is shared) hits both alike."""
    big_headers = {**ENV, "Content-Type": "application/json"}
    idle, busy, big_times, responses, overlapped = [], [], [], [], 0
    with httpx.Client(base_url=base, timeout=TIMEOUT, headers=ENV) as c, \
            httpx.Client(base_url=base, timeout=TIMEOUT) as bc:
        _timed_small(c)  # warm (connection, first-request costs)
        for _ in range(rounds):
            idle.append(_timed_small(c))
            span: list[float] = []

            def send_big():
                t0 = time.perf_counter()
                responses.append(bc.post("/v1/completions", content=big, headers=big_headers))
                span[:] = [t0, time.perf_counter()]

            th = threading.Thread(target=send_big)
            th.start()
            time.sleep(0.005)  # the upload has begun
            s0 = time.perf_counter()
            busy.append(_timed_small(c))
            th.join(TIMEOUT)
            assert not th.is_alive()
            big_times.append(span[1] - span[0])
            overlapped += s0 < span[1]  # the small request started while the big one was in flight
    return dict(idle=idle, busy=busy, big=big_times, responses=responses, overlapped=overlapped,
                idle_med=statistics.median(idle), busy_med=statistics.median(busy))


def test_huge_prompt_is_rejected_without_stalling_others(env_keyed):
    big = json.dumps({"model": "smollm2", "prompt": "hello world " * (BIG_CHARS // 12),
                      "max_tokens": 4}).encode()
    assert 20_000_000 < len(big) < 32 * (1 << 20)
    rounds = 7
    # The bound is 2x an idle server's latency. 50 ms absolute slack: on this shared
    # 2-core machine the test client (sending 20 MB from a thread) and the server's frontend
    # and scheduler processes compete for the same two cores, which adds scheduling jitter
    # of a few tens of ms unrelated to the server's design; a real stall (parsing or
    # tokenizing 20 MB on the event loop) costs seconds, far above it.
    # Up to 3 attempts: other jobs on the shared machine can stall any sample for seconds
    # (seen: 3 s for an idle request). A genuine stall is systematic and fails every
    # attempt; transient outside load does not repeat three times.
    attempts = []
    for _ in range(3):
        m = _latency_round(env_keyed, big, rounds)
        attempts.append(m)
        for r in m["responses"]:
            err = _assert_openai_error(r, 400)
            assert "cannot fit the model's context length" in err["message"], err
        assert m["overlapped"] >= rounds // 2, "the small requests did not overlap the big one"
        print(f"\nidle small /generate: {[round(x * 1000) for x in m['idle']]} ms "
              f"(median {m['idle_med'] * 1000:.0f})\nwith a 20 MB prompt in flight: "
              f"{[round(x * 1000) for x in m['busy']]} ms (median {m['busy_med'] * 1000:.0f}); "
              f"the 20 MB request took {[round(x * 1000) for x in m['big']]} ms; "
              f"overlapped {m['overlapped']}/{rounds}")
        if m["busy_med"] <= 2 * m["idle_med"] + 0.05:
            return
    pytest.fail("small requests are stalled by a concurrent 20 MB prompt: " + "; ".join(
        f"idle median {m['idle_med'] * 1000:.0f} ms, busy median {m['busy_med'] * 1000:.0f} ms"
        for m in attempts))


def test_huge_chat_content_is_rejected_fast(env_keyed):
    big = json.dumps({"model": "smollm2", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hello world " * (BIG_CHARS // 12)}]}).encode()
    t0 = time.perf_counter()
    r = httpx.post(env_keyed + "/v1/chat/completions", content=big, timeout=TIMEOUT,
                   headers={**ENV, "Content-Type": "application/json"})
    elapsed = time.perf_counter() - t0
    err = _assert_openai_error(r, 400)
    assert "cannot fit the model's context length" in err["message"], err
    print(f"\n20 MB chat content rejected in {elapsed * 1000:.0f} ms")
    assert elapsed < 5, elapsed
    r = httpx.post(env_keyed + "/generate", json=SMALL, headers=ENV, timeout=TIMEOUT)
    assert r.status_code == 200


# ---- 5. $ref is never fetched -----------------------------------------------------------
@pytest.fixture(scope="module")
def schema_host():
    """A local HTTP server that would serve a schema, counting every request it gets."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            data = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", hits
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


def test_external_schema_refs_are_rejected_never_fetched(keyed, schema_host):
    url, hits = schema_host
    # sanity: the schema host answers (so 0 hits below means the server never asked)
    assert httpx.get(url + "/probe.json", timeout=5).json() == {"type": "string"}
    assert hits == ["/probe.json"]
    hits.clear()
    refs = [url + "/s.json", "file:///etc/passwd"]
    schemas = []
    for ref in refs:
        schemas += [{"$ref": ref},
                    {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]},
                    # a property named like a data keyword still holds a schema
                    {"type": "object", "properties": {"enum": {"$ref": ref}}}]
    with httpx.Client(base_url=keyed, timeout=TIMEOUT, headers=USER) as c:
        for schema in schemas:
            ref = json.dumps(schema)
            reqs = [
                ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "json_schema": schema}}),
                ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                 "json_schema": json.dumps(schema)}}),
                ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "max_tokens": 4,
                                          "response_format": {"type": "json_schema", "json_schema": {
                                              "name": "s", "schema": schema}}}),
                ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 4,
                                     "json_schema": schema}),
            ]
            for path, body in reqs:
                err = _assert_openai_error(c.post(path, json=body), 400)
                assert "not a local reference" in err["message"], (path, ref, err)
        # control: a local reference is accepted and constrains the output
        local = {"$defs": {"n": {"type": "integer"}}, "type": "object",
                 "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}
        r = c.post("/generate", json={"text": "JSON:", "sampling_params": {
            "max_new_tokens": 20, "temperature": 0, "json_schema": local}})
        assert r.status_code == 200, r.text
    time.sleep(0.5)  # a fetch, if any had been started, would have arrived by now
    assert hits == [], hits
