"""GET /metrics on the shared real server (``server`` in conftest.py runs --enable-metrics):
requests move the frontend's counters and latency histograms, and the entry rank's
throttled message moves the scheduler gauges and the grammar counters. Parsed with
Prometheus' own text parser. The server is shared, so everything is compared as deltas."""
from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from test_metrics import samples, value

pytestmark = pytest.mark.timeout(180)


def scrape(base: str) -> dict:
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return samples(r.text)


def wait_for(base: str, ok, what: str, timeout: float = 15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        p = scrape(base)
        if ok(p):
            return p
        if time.time() > deadline:
            pytest.fail(f"/metrics never showed {what}")
        time.sleep(0.2)


def generate(base: str, text: str, max_new_tokens: int, stream: bool = False, **sampling) -> None:
    body = {"text": text, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}}
    if not stream:
        r = httpx.post(base + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return
    with httpx.stream("POST", base + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


def test_requests_move_the_scraped_metrics(server):
    before = scrape(server)
    # A streaming request long enough (> the 1 s reporting interval) to be seen running.
    long = threading.Thread(target=generate, args=(server, "Tell me a story.", 64, True),
                            kwargs={"ignore_eos": True})
    long.start()
    try:
        wait_for(server, lambda p: value(p, "sglang:num_running_reqs", dp_rank="0") >= 1, "a running request")
    finally:
        long.join()
    # A schema no other test uses: a cache miss and a compile, then a hit for the same one.
    schema = json.dumps({"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "integer"}},
                         "additionalProperties": False})
    for _ in range(2):
        generate(server, "Answer in JSON:", 12, json_schema=schema)

    def delta(p: dict, name: str, **labels) -> float:
        return value(p, name, **labels) - value(before, name, **labels)

    compiled = dict(name="sglang:grammar_compilation_time_seconds_count", backend="xgrammar", kind="json_schema")
    after = wait_for(server, lambda p: (delta(p, **compiled) >= 1 and delta(p, "sglang:num_grammar_cache_hit_total") >= 1
                                        and value(p, "sglang:num_running_reqs", dp_rank="0") == 0),
                     "the grammar counters move and the running gauge drop to 0")
    assert delta(after, "sglang:num_grammar_cache_miss_total") >= 1
    assert delta(after, "sglang:num_grammar_total") >= 2
    assert value(after, "sglang:num_queue_reqs", dp_rank="0", model_name="smollm2") == 0
    assert value(after, "sglang:max_total_num_tokens", dp_rank="0") == 4096  # --max-total-tokens
    assert 0 <= value(after, "sglang:token_usage", dp_rank="0") <= 1
    assert delta(after, "sglang:num_requests_total") >= 3
    assert delta(after, "sglang:num_so_requests_total") >= 2
    assert delta(after, "sglang:generation_tokens_total") >= 64
    assert delta(after, "sglang:prompt_tokens_total") > 0
    assert delta(after, "sglang:time_to_first_token_seconds_count") >= 1
    assert delta(after, "sglang:inter_token_latency_seconds_count") >= 32
    assert delta(after, "sglang:e2e_request_latency_seconds_count") >= 3
