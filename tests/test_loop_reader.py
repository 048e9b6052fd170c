"""srt/transport/loop_reader.py on real ZMQ sockets (PUSH -> PULL over inproc) and both
event loops the frontend runs on: every message delivered once, in order, whenever it
was sent (before the reader started, in a burst larger than one wake drains, after the
socket went quiet: ZMQ's FD is edge-triggered), a failing handler costs only its own
message, and stop() leaves no reader behind."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import zmq

from srt.transport.loop_reader import MAX_MESSAGES_PER_WAKE, LoopReader

uvloop = pytest.importorskip("uvloop")
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def loop(request):
    lp = LOOPS[request.param]()
    yield lp
    lp.close()


@pytest.fixture
def pair():
    ctx = zmq.Context()
    addr = f"inproc://loop-reader-{uuid.uuid4().hex}"
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    yield push, pull
    push.close(0)
    pull.close(0)
    ctx.term()


async def _until(pred, timeout=10.0):
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.001)


def test_every_message_once_in_order(loop, pair):
    push, pull = pair
    got: list[bytes] = []
    reader = LoopReader(pull, got.append)
    early = [b"early-%d" % i for i in range(3)]
    burst = [b"burst-%d" % i for i in range(3 * MAX_MESSAGES_PER_WAKE + 7)]
    late = [b"late-%d" % i for i in range(5)]

    async def main():
        for m in early:  # queued before the FD is watched
            push.send(m)
        task = asyncio.create_task(reader.run())
        await _until(lambda: len(got) == len(early))
        for m in burst:  # more than one wake drains: the reader continues by itself
            push.send(m)
        await _until(lambda: len(got) == len(early) + len(burst))
        await asyncio.sleep(0.05)  # quiet: the next message must signal again
        for m in late:
            push.send(m)
            await asyncio.sleep(0.002)
        await _until(lambda: len(got) == len(early) + len(burst) + len(late))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(main())
    assert got == early + burst + late


def test_a_failing_handler_costs_only_its_message(loop, pair):
    push, pull = pair
    got: list[bytes] = []

    def handle(data: bytes) -> None:
        if data == b"bad":
            raise ValueError("boom")
        got.append(data)

    async def main():
        task = asyncio.create_task(LoopReader(pull, handle).run())
        for m in (b"a", b"bad", b"b"):
            push.send(m)
        await _until(lambda: len(got) == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    loop.run_until_complete(main())
    assert got == [b"a", b"b"]


def test_stop_unwatches_before_close(loop, pair):
    push, pull = pair
    got: list[bytes] = []
    reader = LoopReader(pull, got.append)

    async def main():
        task = asyncio.create_task(reader.run())
        push.send(b"x")
        await _until(lambda: got == [b"x"])
        reader.stop()
        # The FD is no longer watched: a message now stays queued instead of reaching
        # the handler.
        push.send(b"y")
        await asyncio.sleep(0.05)
        assert got == [b"x"]
        reader.stop()  # idempotent
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert pull.recv(zmq.NOBLOCK) == b"y"

    loop.run_until_complete(main())
