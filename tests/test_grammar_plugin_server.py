"""A registered third-party backend through the real server: loaded by
--grammar-backend-plugins, and a compile slower than SGLANG_GRAMMAR_MAX_POLL_ITERATIONS
polls is a 400 with the documented message while other requests are served."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from conftest import _launch_server


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory, tiny_dir):
    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
           "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS": "40", "SGLANG_GRAMMAR_POLL_INTERVAL": "0.01"}
    yield from _launch_server(tmp_path_factory, tiny_dir,
                              ["--grammar-backend", "slow", "--grammar-backend-plugins", "slow_grammar_plugin"], env)


def compiling_workers() -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if cmd.startswith("gramsync::grammar_compile") and "(compiling regex)" in cmd:
            found.append(p)
    return found


def generate(base, regex):
    body = {"text": "Write a number:", "sampling_params": {"regex": regex, "max_new_tokens": 8, "temperature": 0}}
    return httpx.post(base + "/generate", json=body, timeout=120)


def pool_ready(base) -> None:
    """The compile pool builds its backend while the model loads and may finish after the
    server is up: with this fixture's 40-poll budget, wait until a compile succeeds."""
    for _ in range(120):
        if generate(base, "[0-9]").status_code == 200:
            return
        time.sleep(0.5)
    raise AssertionError("no grammar compiled within 60 s of start-up")


@pytest.mark.timeout(240)
def test_slow_plugin_backend_times_out_while_others_complete(slow_server):
    pool_ready(slow_server)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(generate, slow_server, "slow[0-9]+")
        fast = pool.submit(generate, slow_server, "[0-9]{3}")
        slow, fast = slow.result(), fast.result()
    assert slow.status_code == 400, slow.text
    assert slow.json()["error"]["message"] == (
        "Grammar preprocessing timed out: the regex grammar was not compiled within 40 "
        "scheduler polls (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS).")
    assert fast.status_code == 200, fast.text
    assert len(fast.json()["text"]) == 3 and fast.json()["text"].isdigit()
    # The timed-out request released its grammar: the compile pool killed the 20 s compile
    # (its worker's title says "(compiling regex)" while it runs).
    deadline = time.monotonic() + 1.5
    while compiling_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not compiling_workers()
    again = generate(slow_server, "[0-9]{3}")  # the server is fine afterwards
    assert again.status_code == 200 and again.json()["text"] == fast.json()["text"]
