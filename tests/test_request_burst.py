"""The entry rank's request receiver collects a burst after an idle spell
(GRAMSYNC_SCHEDULER_BATCH_WAIT): requests that follow each other within the burst gap are
scheduled together, the burst stops at the wait's end or at the first empty gap, and a
busy scheduler (block=False) never waits. Real ZMQ sockets over ipc:// in a private
directory; the gap is widened to 150 ms so thread scheduling on a loaded CI machine
cannot decide the outcome."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from distributed.parallel_state import SINGLE_RANK, RankInfo
from srt.transport.io_struct import SCHEDULER_INPUT_CODEC, AbortReq
from srt.transport.request_receiver import RequestReceiver
from srt.transport.zmq_transport import ZmqTransport

GAP_MS = 150


@pytest.fixture
def receiver_and_push(tmp_path, monkeypatch):
    def make(batch_wait_s: float):
        monkeypatch.setenv("GRAMSYNC_SCHEDULER_BATCH_WAIT", str(batch_wait_s))
        monkeypatch.setenv("GRAMSYNC_SCHEDULER_IDLE_WAIT", "2")
        monkeypatch.setattr(RequestReceiver, "BURST_GAP_MS", GAP_MS)
        d = tmp_path / f"ipc{len(made)}"
        d.mkdir(mode=0o700)
        transport = ZmqTransport()
        made.append(transport)
        rx = RequestReceiver(transport, f"ipc://{d}/in", RankInfo(), SINGLE_RANK)
        return rx, transport.connect(zmq.PUSH, rx.address)

    made: list[ZmqTransport] = []
    yield make
    for t in made:
        t.close()


def _send_later(push, delays_s: list[float]) -> threading.Thread:
    """Send one abort per delay (seconds after the previous send), on a thread."""
    def run():
        for i, d in enumerate(delays_s):
            time.sleep(d)
            push.send(SCHEDULER_INPUT_CODEC.encode(AbortReq(f"r{i}")))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_burst_is_collected_into_one_iteration(receiver_and_push):
    rx, push = receiver_and_push(batch_wait_s=5.0)
    sender = _send_later(push, [0.05, 0.04, 0.04, 0.04])  # each well inside the 150 ms gap
    got = rx.recv(block=True, extra=[])
    sender.join(5)
    assert [m.rid for m in got] == ["r0", "r1", "r2", "r3"]


def test_an_empty_gap_ends_the_burst_and_a_lone_request_waits_one_gap(receiver_and_push):
    rx, push = receiver_and_push(batch_wait_s=5.0)
    sender = _send_later(push, [0.05, 0.6])  # the second comes after an empty gap
    t = time.monotonic()
    first = rx.recv(block=True, extra=[])
    waited = time.monotonic() - t
    assert [m.rid for m in first] == ["r0"]
    assert waited < 0.05 + GAP_MS / 1000 + 0.3  # arrival + one empty gap (+ slack)
    second = rx.recv(block=True, extra=[])
    sender.join(5)
    assert [m.rid for m in second] == ["r1"]


def test_the_wait_bounds_a_burst_and_zero_disables_it(receiver_and_push):
    rx, push = receiver_and_push(batch_wait_s=0.2)
    sender = _send_later(push, [0.02] + [0.1] * 6)  # a steady stream: never an empty gap
    t = time.monotonic()
    got = rx.recv(block=True, extra=[])
    assert time.monotonic() - t < 0.02 + 0.2 + GAP_MS / 1000 + 0.3
    assert 1 <= len(got) < 7  # cut by the 0.2 s wait, not by the stream's end
    sender.join(5)

    rx0, push0 = receiver_and_push(batch_wait_s=0.0)
    sender = _send_later(push0, [0.02, 0.01, 0.01])
    assert [m.rid for m in rx0.recv(block=True, extra=[])] == ["r0"]
    sender.join(5)


def test_a_busy_scheduler_never_waits(receiver_and_push):
    rx, push = receiver_and_push(batch_wait_s=5.0)
    push.send(SCHEDULER_INPUT_CODEC.encode(AbortReq("now")))
    deadline = time.monotonic() + 5
    got = []
    while not got and time.monotonic() < deadline:  # block=False: whatever is there
        got = rx.recv(block=False, extra=[])
    t = time.monotonic()
    assert [m.rid for m in got] == ["now"]
    assert rx.recv(block=False, extra=[AbortReq("extra")])[0].rid == "extra"
    assert time.monotonic() - t < 0.1
