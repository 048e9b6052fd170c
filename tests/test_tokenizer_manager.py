"""TokenizerManager against a FAKE in-test scheduler (tests/fake_scheduler.py) that speaks
the real ZMQ protocol; it stands in for the real scheduler only in these unit tests."""
import asyncio
import contextlib

import pytest

from fake_scheduler import FakeScheduler
from srt.transport.io_struct import PortArgs, SchedulerInfo
from srt.frontend.tokenizer_manager import GenerateReqInput, TokenizerManager
from srt.server_args import ServerArgs

pytestmark = pytest.mark.timeout(120)

INFO = SchedulerInfo(max_total_num_tokens=256, max_running_requests=8, context_len=512,
                     vocab_size=49152, eos_token_ids=(2,))
REPLY = " The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@contextlib.asynccontextmanager
async def frontend(tok, script=None, step_delay=0.002):
    port_args = PortArgs.new()
    script = script if script is not None else tok.encode(REPLY, add_special_tokens=False)
    # The frontend binds its output socket first (as in the real launch, where the ranks'
    # PUSH sockets are connected long before requests): otherwise the fake's outputs wait
    # for a ZMQ reconnect and arrive in one burst.
    tm = TokenizerManager(ServerArgs(), port_args, INFO, tok)
    fake = FakeScheduler(port_args, tok, script, eos_id=2, step_delay=step_delay).start()
    tm.start_handle_loop()
    try:
        yield tm, fake
    finally:
        tm.close()
        fake.shutdown()


async def collect(tm, **kw):
    return [o async for o in tm.generate_request(GenerateReqInput(**kw))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_non_stream_returns_one_sglang_shaped_dict(tok):
    async def main():
        async with frontend(tok) as (tm, fake):
            outs = await collect(tm, text="Hi", sampling_params={"max_new_tokens": 5}, rid="r1")
            return outs, tok.encode("Hi")
    outs, prompt = run(main())
    assert len(outs) == 1
    out = outs[0]
    script = tok.encode(REPLY, add_special_tokens=False)
    assert out["output_ids"] == script[:5]
    assert out["text"] == tok.decode(script[:5])
    assert out["meta_info"] == {"id": "r1", "prompt_tokens": len(prompt), "completion_tokens": 5, "cached_tokens": 0, "fast_forward_tokens": 0,
                                "finish_reason": {"type": "length", "length": 5}}


def test_stream_yields_growing_prefixes(tok):
    async def main():
        async with frontend(tok) as (tm, _):
            return await collect(tm, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8}, stream=True)
    outs = run(main())
    assert len(outs) >= 2
    for a, b in zip(outs, outs[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert outs[-1]["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_from_text(tok, stream):
    async def main():
        async with frontend(tok) as (tm, _):
            return await collect(tm, text="x", stream=stream,
                                 sampling_params={"max_new_tokens": 30, "stop": ["fox"]})
    outs = run(main())
    assert outs[-1]["text"] == " The quick brown "
    assert outs[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "fox"}
    assert all("fox" not in o["text"] and "f" not in o["text"] for o in outs)


def test_eos_is_counted_but_not_shown(tok):
    script = tok.encode(" Hi!", add_special_tokens=False) + [2]
    async def main():
        async with frontend(tok, script=script) as (tm, _):
            return await collect(tm, text="x", sampling_params={"skip_special_tokens": False})
    out = run(main())[-1]
    assert out["text"] == " Hi!"
    assert out["output_ids"] == script
    assert out["meta_info"]["completion_tokens"] == len(script)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": ""}, "empty"),
        ({"input_ids": []}, "empty"),
        ({}, "text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "text or input_ids"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"input_ids": [5] * 600}, "The input (600 tokens) is longer than the model's context length (512 tokens)."),
        ({"input_ids": [5] * 300}, "KV cache pool"),
        ({"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 600}}, "maximum context length of 512"),
        ({"text": "hi", "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ],
)
def test_bad_input_raises_before_sending(tok, kw, msg):
    async def main():
        async with frontend(tok) as (tm, fake):
            with pytest.raises(ValueError) as e:
                await collect(tm, **kw)
            await asyncio.sleep(0.05)
            return str(e.value), list(fake.received), dict(tm.rid_to_state)
    err, received, states = run(main())
    assert msg in err
    assert received == [] and states == {}


def test_no_max_new_tokens_fills_the_room_left(tok):
    async def main():
        async with frontend(tok) as (tm, _):
            req = tm.prepare_request(GenerateReqInput(input_ids=[5] * 50, sampling_params={"max_new_tokens": None}))
            default = tm.prepare_request(GenerateReqInput(input_ids=[5] * 50))
            return req.sampling_params.max_new_tokens, default.sampling_params.max_new_tokens
    filled, default = run(main())
    assert filled == 256 - 50  # min(context 512, pool 256) - prompt
    assert default == 128  # SGLang's native default


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_consumer_going_away_aborts_in_scheduler(tok, how):
    async def main():
        async with frontend(tok, step_delay=0.02) as (tm, fake):
            gen = tm.generate_request(GenerateReqInput(text="x", rid="gone", stream=True,
                                                       sampling_params={"max_new_tokens": 500}))
            if how == "aclose":
                await gen.__anext__()
                await gen.aclose()
            else:
                async def consume():
                    async for _ in gen:
                        pass
                task = asyncio.create_task(consume())
                await asyncio.sleep(0.2)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for _ in range(100):
                if fake.aborted_rids:
                    break
                await asyncio.sleep(0.02)
            # The frontend keeps serving.
            again = await collect(tm, text="x", sampling_params={"max_new_tokens": 3})
            return fake.aborted_rids, tm.num_aborted, dict(tm.rid_to_state), again
    aborted, n, states, again = run(main())
    assert aborted == ["gone"] and n == 1 and states == {}
    assert again[-1]["meta_info"]["completion_tokens"] == 3


def test_abort_request_finishes_with_abort_reason(tok):
    async def main():
        async with frontend(tok, step_delay=0.02) as (tm, _):
            async def later():
                await asyncio.sleep(0.1)
                tm.abort_request("ab")
            asyncio.create_task(later())
            return await collect(tm, text="x", rid="ab", sampling_params={"max_new_tokens": 500})
    fr = run(main())[-1]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["message"] and fr["status_code"] == 499


def test_concurrent_requests_are_routed_by_rid(tok):
    async def main():
        async with frontend(tok) as (tm, _):
            return await asyncio.gather(*[
                collect(tm, text="x", rid=f"c{i}", stream=i % 2 == 0, sampling_params={"max_new_tokens": 2 + i})
                for i in range(6)
            ])
    results = run(main())
    for i, outs in enumerate(results):
        assert outs[-1]["meta_info"]["id"] == f"c{i}"
        assert outs[-1]["meta_info"]["completion_tokens"] == 2 + i


@pytest.mark.parametrize(
    "body,msg",
    [([], "JSON object"), ({"text": ["a", "b"]}, "text is a list"), ({"text": "a", "rid": ["r"]}, "rid is a list"), ({"text": "a", "foo": 1}, "foo"),
     ({"text": "a", "stream": "yes"}, "stream"), ({"input_ids": ["a"]}, "input_ids")],
)
def test_generate_req_input_from_dict_rejects(body, msg):
    with pytest.raises(ValueError, match=msg):
        GenerateReqInput.from_dict(body)
