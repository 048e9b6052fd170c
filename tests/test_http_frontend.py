"""The HTTP layer (FastAPI app + OpenAI protocol) served by uvicorn in a thread, in front
of a FAKE in-test scheduler (tests/fake_scheduler.py) that stands in for the real one
only in these unit tests. tests/test_http_server.py checks the real server end to end."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from fake_scheduler import ABORT_MAGIC, FakeScheduler
from sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
from srt.entrypoints.http_server import create_app
from srt.transport.io_struct import PortArgs, SchedulerInfo
from srt.frontend.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.tokenizer_utils import apply_chat_template

pytestmark = pytest.mark.timeout(120)

INFO = SchedulerInfo(max_total_num_tokens=4096, max_running_requests=8, context_len=8192,
                     vocab_size=49152, eos_token_ids=(2,))
REPLY = " The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Say something."}]
DISALLOW = DisallowedTokensLogitsProcessor.to_str()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_tokenizer):
    tok = smollm2_tokenizer
    port_args = PortArgs.new()
    fake = FakeScheduler(port_args, tok, tok.encode(REPLY, add_special_tokens=False), eos_id=2,
                         step_delay=0.01).start()
    args = ServerArgs(served_model_name="fake-smollm2", port=_free_port())
    tm = TokenizerManager(args, port_args, INFO, tok)  # built outside the loop, like launch_server
    srv = uvicorn.Server(uvicorn.Config(create_app(tm, args), host="127.0.0.1", port=args.port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield {"base": base, "tok": tok, "fake": fake, "tm": tm}
    srv.should_exit = True
    th.join(timeout=10)
    fake.shutdown()
    tm.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", timeout=30, max_retries=0)


def _script(tok, n):
    return tok.decode(tok.encode(REPLY, add_special_tokens=False)[:n])


def test_chat_non_stream(server, client):
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)
    assert r.choices[0].message.content == _script(server["tok"], 5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(apply_chat_template(server["tok"], MESSAGES))
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.object == "chat.completion" and r.model == "m"


def test_chat_stream_with_usage(server, client):
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _script(server["tok"], 6)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completion_stop_string(server, client):
    r = client.completions.create(model="m", prompt="Once", max_tokens=16, stop=["fox"])
    assert r.choices[0].text == " The quick brown " and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(server["tok"].encode("Once"))
    chunks = list(client.completions.create(model="m", prompt="Once", max_tokens=16, stop=["fox"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " The quick brown "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_generate_native(server):
    r = httpx.post(server["base"] + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}, timeout=30)
    out = r.json()
    assert r.status_code == 200 and out["text"] == _script(server["tok"], 4)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert out["meta_info"]["completion_tokens"] == 4 and len(out["output_ids"]) == 4
    with httpx.stream("POST", server["base"] + "/generate", timeout=30,
                      json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    outs = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert outs[-1]["text"] == _script(server["tok"], 4) and outs[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["fake-smollm2"]
    assert httpx.get(server["base"] + "/health_generate", timeout=30).status_code == 200


BAD = [
    ("/v1/chat/completions", b'{"model": "m", "messages": [', "Malformed JSON"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "n": 0}, "n must be in [1, 128], got 0"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "presence_penalty": 2.5},
     "presence_penalty must be in [-2, 2], got 2.5"),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias keys"),
    ("/v1/completions", {"model": "m", "prompt": "a", "regex": "a+", "ebnf": "root ::= 'a'"},
     "Only one constraint kind per request is allowed, got regex and ebnf."),
    # This server runs without --enable-custom-logit-processor.
    ("/v1/completions", {"model": "m", "prompt": "a", "custom_logit_processor": DISALLOW},
     "--enable-custom-logit-processor"),
    ("/generate", {"text": "hi", "custom_logit_processor": DISALLOW}, "--enable-custom-logit-processor"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{oops"}}, "json_schema is not valid JSON"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/completions", {"model": "m", "prompt": "hi " * 9000}, "longer than the model's context length"),
    ("/v1/completions", {"model": "m", "prompt": "hi " * 5000}, "KV cache pool"),
    ("/v1/completions", {"model": "m", "prompt": ["a", ""]}, "prompt[1]: The input is empty"),
    ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 0}, "only allowed with echo"),
    ("/generate", {"text": ["a", ""]}, "Batch item 1: The input is empty"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}],
                              "continue_final_message": True}, "needs the last message to be the assistant's"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "hi", "nope": 1}, "nope"),
]


@pytest.mark.parametrize("path,body,msg", BAD)
def test_bad_input_is_400_while_good_request_runs(server, path, body, msg):
    result = {}

    def good():
        r = httpx.post(server["base"] + "/generate", timeout=30,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 20}})
        result["good"] = r
    th = threading.Thread(target=good)
    th.start()
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server["base"] + path, timeout=30, **kw)
    th.join(timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert msg in err["message"] and err["code"] == 400 and err["type"] == "BadRequestError"
    assert result["good"].status_code == 200 and result["good"].json()["meta_info"]["completion_tokens"] == 20


def test_openai_sampling_fields_reach_the_scheduler(server, client):
    r = client.completions.create(model="m", prompt="Once", max_tokens=3, frequency_penalty=0.5,
                                  presence_penalty=0.25, logit_bias={"17": -100}, seed=4,
                                  extra_body={"repetition_penalty": 1.1, "min_p": 0.05, "top_k": 7})
    rid = r.id.removeprefix("cmpl-")
    p = next(m for m in server["fake"].received if getattr(m, "rid", None) == rid).sampling_params
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (p.logit_bias, p.seed, p.min_p, p.top_k, p.max_new_tokens) == (((17, -100.0),), 4, 0.05, 7, 3)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="m", messages=MESSAGES, top_p=2)


def _wait_aborted(server, rid_count_before, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = httpx.get(server["base"] + "/get_server_info", timeout=5).json()
        if info["num_inflight_requests"] == 0 and len(server["fake"].aborted_rids) > rid_count_before:
            return info
        time.sleep(0.05)
    raise AssertionError(f"request was not aborted: {info}")


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 3000}}),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 3000, "stream": True}),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 3000, "stream": True}),
])
def test_streaming_client_disconnect_aborts(server, path, body):
    before = len(server["fake"].aborted_rids)
    with httpx.stream("POST", server["base"] + path, timeout=30, json=body) as r:
        next(r.iter_lines())
    _wait_aborted(server, before)
    r = httpx.post(server["base"] + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3000}}),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 3000}),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 3000}),
])
def test_non_streaming_client_disconnect_aborts(server, path, body):
    before = len(server["fake"].aborted_rids)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server["base"] + path, json=body, timeout=httpx.Timeout(30, read=0.5))
    _wait_aborted(server, before)


def test_scheduler_abort_becomes_an_error(server, client):
    msg = "Fake scheduler timed the request out."
    r = httpx.post(server["base"] + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": MESSAGES, "max_tokens": ABORT_MAGIC})
    assert r.status_code == 503 and r.json()["error"]["message"] == msg
    r = httpx.post(server["base"] + "/generate", timeout=30,
                   json={"text": "x", "sampling_params": {"max_new_tokens": ABORT_MAGIC}})
    assert r.status_code == 503 and r.json()["error"]["message"] == msg
    with pytest.raises(openai.APIError, match=msg):  # mid-stream: an SSE error event
        list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=ABORT_MAGIC, stream=True))
    with pytest.raises(openai.APIError, match=msg):
        list(client.completions.create(model="m", prompt="x", max_tokens=ABORT_MAGIC, stream=True))
    with httpx.stream("POST", server["base"] + "/generate", timeout=30, json={
            "text": "x", "stream": True, "sampling_params": {"max_new_tokens": ABORT_MAGIC}}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": msg, "status_code": 503}
