"""Wall-clock timeouts at TP=2 and at --pp-size 2 behave as at TP=1: the entry rank decides
them and broadcasts them as aborts (to its TP peers; with pipeline stages, to every stage),
so both ranks drop the request in the same step."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import httpx
import openai
import pytest

from conftest import _launch_server


LONG = 7000  # new tokens asked for by every request meant to time out (the model's limit: 8,192)
LAYOUTS = {"tp2": (["--tp-size", "2"], ("DP0_TP0", "DP0_TP1")),
           "pp2": (["--pp-size", "2"], ("DP0_PP0_TP0", "DP0_PP1_TP0"))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def timeout_server(request, tmp_path_factory, tiny_dir):
    """(base URL, batch-log dir, the two ranks' names)."""
    flags, ranks = LAYOUTS[request.param]
    log_dir = str(tmp_path_factory.mktemp("batches"))
    env = {"SGLANG_REQ_RUNNING_TIMEOUT": "3", "GRAMSYNC_BATCH_LOG_DIR": log_dir}
    # A pool for every request of a test at once, each long enough that none can end in the
    # 3 s, even alone and with speculation's drafts (CI saw a request of 250 tokens end inside them).
    pool = ["--max-total-tokens", str(14 * (LONG + 64))]
    for base in _launch_server(tmp_path_factory, tiny_dir, [*flags, *pool], env):
        yield base, log_dir, ranks


def _lines(log_dir: str, rank: str) -> list[str]:
    with open(os.path.join(log_dir, f"batches_{rank}.log")) as f:
        return f.read().split("\n")[:-1]


@pytest.mark.timeout(240)
def test_running_timeout_aborts_on_every_rank(timeout_server):
    base, log_dir, ranks = timeout_server

    def generate(rid: str, max_new_tokens: int) -> httpx.Response:
        body = {"rid": rid, "text": "Tell me a long story.",
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                    "ignore_eos": True}}
        return httpx.post(base + "/generate", json=body, timeout=120)

    with cf.ThreadPoolExecutor(3) as pool:
        long = pool.submit(generate, "too-long", LONG)
        short = [pool.submit(generate, f"short-{i}", 4) for i in range(2)]
        results = [f.result() for f in short]
        aborted = long.result()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert aborted.status_code == 503, aborted.text
    assert "SGLANG_REQ_RUNNING_TIMEOUT" in aborted.json()["error"]["message"], aborted.text
    deadline = time.monotonic() + 15  # a rank may still be writing its last line
    while True:
        rank0, rank1 = (_lines(log_dir, rank) for rank in ranks)
        if rank0 == rank1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rank0 and rank0 == rank1, "the ranks ran different batches"
    # It ran for a while (3 s of decode steps) and then left both ranks' batches together.
    assert sum("too-long" in line for line in rank0) > 3


TIMEOUT_MESSAGE = "SGLANG_REQ_RUNNING_TIMEOUT"
# Every request of the test runs at once: 13 scheduler requests x (prompt + LONG) < the pool.
TIMED = {"max_new_tokens": LONG, "ignore_eos": True}


def _native(base: str, body: dict) -> tuple[int, list]:
    """(status, the stream's data events or [the body])."""
    if not body.get("stream"):
        r = httpx.post(base + "/generate", json=body, timeout=120)
        return r.status_code, [r.json()]
    with httpx.stream("POST", base + "/generate", json=body, timeout=120) as r:
        return r.status_code, [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def _openai(base: str, kind: str, stream: bool, **kw):
    """The openai client's answer: the exception it raised (the test expects one)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    try:
        if kind == "chat":
            out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A story."}],
                                                 max_tokens=LONG, stream=stream, extra_body={"ignore_eos": True}, **kw)
        else:
            out = client.completions.create(model="m", prompt="Once upon a time", max_tokens=LONG, stream=stream,
                                            extra_body={"ignore_eos": True}, **kw)
        list(out) if stream else None
    except openai.APIError as e:
        return e
    return None


@pytest.mark.timeout(240)
def test_a_timeout_is_an_error_on_every_path(timeout_server):
    """A timeout abort answers as docs/api.md says on every path: a non-streaming request
    (native, chat, completions; n > 1, a batch) is a 503 naming the limit; an OpenAI stream
    ends with the 503 error event; a native stream's last event has the abort finish reason
    with status 503."""
    base = timeout_server[0]
    native = {"plain": {"text": "A story.", "sampling_params": TIMED},
              "n=2": {"text": "A story.", "sampling_params": {**TIMED, "n": 2}},
              "batch": {"text": ["A story.", "A poem."], "sampling_params": TIMED},
              "stream": {"text": "A story.", "sampling_params": TIMED, "stream": True}}
    oai = {"chat": ("chat", False, {}), "chat n=2": ("chat", False, {"n": 2}), "chat stream": ("chat", True, {}),
           "completions": ("completions", False, {}), "completions stream": ("completions", True, {})}
    with cf.ThreadPoolExecutor(len(native) + len(oai)) as pool:
        nat = {k: pool.submit(_native, base, b) for k, b in native.items()}
        api = {k: pool.submit(_openai, base, *v[:2], **v[2]) for k, v in oai.items()}
        nat, api = {k: f.result() for k, f in nat.items()}, {k: f.result() for k, f in api.items()}
    for name in ("plain", "n=2", "batch"):
        status, (body,) = nat[name]
        assert status == 503 and TIMEOUT_MESSAGE in body["error"]["message"], (name, body)
    status, events = nat["stream"]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    fr = json.loads(events[-2])["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 503 and TIMEOUT_MESSAGE in fr["message"], fr
    for name, err in api.items():
        assert err is not None and TIMEOUT_MESSAGE in str(err), (name, err)
        if not oai[name][1]:  # non-streaming: the HTTP status itself
            assert isinstance(err, openai.APIStatusError) and err.status_code == 503, (name, err)
