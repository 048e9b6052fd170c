"""Graceful drain on SIGTERM (docs/multi-rank.md "Graceful shutdown"), with REAL server processes on CPU.

The signal goes to the server's whole process group, as systemd, a container runtime or
torchrun deliver it: the scheduler ranks get it too and must serve on while the frontend
drains. Checked: new requests and /health get 503 with the shutting-down message; a
running request finishes when it can within --graceful-shutdown-timeout; a longer one is
ended at the timeout (a stream with an SSE error event, then [DONE]; a non-streaming one
with a 503); the server exits 0 and leaves no process behind. TP=1, and TP=2 (two ranks in
lock-step through the drain). A rank that dies mid-stream: test_multi_rank_server.py
``test_killed_rank_stops_the_server``; torchrun: ``test_torchrun_tp2_constrained_and_clean_stop``.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from srt.entrypoints.drain import SHUTTING_DOWN
from test_multi_rank_server import (
    _alive, _descendants, _free_port, _launch_cmd, _popen, _stop, _tail, _wait_healthy, _wait_until,
)

EXIT_WAIT_S = 30
HTTP_TIMEOUT_S = 120
# No background torch.compile: its CPU load on a 2-core machine slows the first tokens a lot.
FLAGS = ("--disable-torch-compile",)


class Client(threading.Thread):
    """One HTTP request on a thread: a stream's ``data:`` payloads in ``events``, or a
    plain response's status and JSON body."""

    def __init__(self, base: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base + path, body
        self.events: list[str] = []
        self.status: int | None = None
        self.json = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            if not self.body.get("stream"):
                r = httpx.post(self.url, json=self.body, timeout=HTTP_TIMEOUT_S)
                self.status, self.json = r.status_code, r.json()
                return
            with httpx.stream("POST", self.url, json=self.body, timeout=HTTP_TIMEOUT_S) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_events(self, n: int, timeout: float = HTTP_TIMEOUT_S) -> None:
        _wait_until(lambda: len(self.events) >= n or not self.is_alive(), timeout, f"{n} events")
        assert len(self.events) >= n, (self.status, self.error, self.events)

    def finish(self, timeout: float = EXIT_WAIT_S) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"{self.url}: no end within {timeout} s"
        assert self.error is None, repr(self.error)


def _chat_stream(base: str, max_tokens: int) -> Client:
    return Client(base, "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True})


def _generate(base: str, max_new_tokens: int, stream: bool) -> Client:
    return Client(base, "/generate", {
        "text": "Once upon a time", "stream": stream,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}})


def _refused(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["message"] == SHUTTING_DOWN


def _start(tmp_path, smollm2_dir, *flags: str):
    port = _free_port()
    log_path = tmp_path / "server.log"
    # A temp folder of its own: the exit is checked to leave no IPC folder behind.
    (tmp_path / "tmp").mkdir()
    proc = _popen(_launch_cmd(smollm2_dir, port, *FLAGS, *flags), log_path,
                  env={"TMPDIR": str(tmp_path / "tmp")})
    return proc, f"http://127.0.0.1:{port}", log_path


def _exits_cleanly(proc, group: list[psutil.Process], log_path) -> float:
    """Wait for exit code 0 and for every process of the server to be gone; the time it took."""
    t0 = time.monotonic()
    try:
        code = proc.wait(EXIT_WAIT_S)
    except Exception:
        pytest.fail(f"server still running {EXIT_WAIT_S} s after SIGTERM:\n{_tail(log_path)}")
    assert code == 0, _tail(log_path)
    _wait_until(lambda: not any(_alive(p) for p in group), 10, "every process of the server to exit")
    left = list((log_path.parent / "tmp").glob("gramsync-ipc-*"))
    assert not left, f"the server left its IPC folder behind: {left}"
    return time.monotonic() - t0


@pytest.mark.timeout(180)
def test_sigterm_drains_then_ends_the_rest_tp1(tmp_path, smollm2_dir):
    timeout_s = 8.0
    proc, base, log_path = _start(tmp_path, smollm2_dir, "--graceful-shutdown-timeout", str(timeout_s))
    group: list[psutil.Process] = []
    try:
        _wait_healthy(proc, base, log_path)
        group = [psutil.Process(proc.pid), *_descendants(proc)]
        # 1000 tokens each: all three fit the 4096-token KV pool at once (none waits in the queue)
        long_stream, long_plain = _chat_stream(base, 1000), _generate(base, 1000, stream=False)
        long_stream.start()
        long_plain.start()
        long_stream.wait_events(2)  # the role chunk, then a token: it is running
        short = _generate(base, 3, stream=True)
        short.start()
        short.wait_events(1)

        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # the frontend and the scheduler rank alike
        _wait_until(lambda: _refused(httpx.get(base + "/health", timeout=5)), 5, "/health to say 503")
        assert _refused(httpx.post(base + "/generate", json={"text": "Hi"}, timeout=5))
        assert _refused(httpx.post(base + "/v1/completions", json={"prompt": "Hi"}, timeout=5))

        short.finish()  # ran to its end: the rank served on through the SIGTERM
        assert short.events[-1] == "[DONE]", short.events[-3:]
        last = json.loads(short.events[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "length", last
        assert last["meta_info"]["completion_tokens"] == 3

        long_stream.finish()
        assert long_stream.status == 200
        assert long_stream.events[-1] == "[DONE]", long_stream.events[-3:]
        error = json.loads(long_stream.events[-2])["error"]
        assert error["code"] == 503 and "--graceful-shutdown-timeout (8 s)" in error["message"], error
        assert time.monotonic() - t0 >= timeout_s - 0.5  # the timeout was honoured

        long_plain.finish()
        assert long_plain.status == 503, long_plain.json
        assert "shutting down" in long_plain.json["error"]["message"]

        _exits_cleanly(proc, group, log_path)
    finally:
        _stop(proc, group)


@pytest.mark.timeout(180)
def test_sigterm_tp2_finishes_the_running_stream_and_exits_0(tmp_path, smollm2_dir):
    proc, base, log_path = _start(tmp_path, smollm2_dir, "--tp-size", "2", "--graceful-shutdown-timeout", "20")
    group: list[psutil.Process] = []
    try:
        _wait_healthy(proc, base, log_path)
        group = [psutil.Process(proc.pid), *_descendants(proc)]
        stream = _chat_stream(base, 16)
        stream.start()
        stream.wait_events(2)
        os.killpg(proc.pid, signal.SIGTERM)  # both TP ranks too: they must stay in lock-step
        stream.finish()
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in stream.events[:-1]]
        assert finish[-1] == "length", stream.events[-3:]
        assert _exits_cleanly(proc, group, log_path) < 15  # no waiting once nothing runs
    finally:
        _stop(proc, group)
