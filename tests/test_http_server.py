"""End to end: a REAL server process (`python launch.py`, the session-wide ``server``
fixture in conftest.py) serving the embedded SmolLM2 on CPU, driven with the official
`openai` client and httpx. Greedy (temperature 0) where the test compares two runs;
max_tokens stays small (~30 tok/s on CPU)."""
import importlib.metadata
import json
import threading
import time
import uuid

import httpx
import openai
import pytest

from srt.tokenizer_utils import apply_chat_template

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Write a long poem about the sea."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=60, max_retries=0)


def _server_info(server) -> dict:
    return httpx.get(server + "/get_server_info", timeout=10).json()


def test_chat_usage_and_length(server, client, smollm2_tokenizer):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(apply_chat_template(smollm2_tokenizer, MESSAGES))
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content


def test_chat_stream_matches_non_stream(server, client):
    kw = dict(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_and_stream(server, client, smollm2_tokenizer):
    kw = dict(model="smollm2", prompt="1, 2, 3,", max_tokens=6, temperature=0)
    r = client.completions.create(**kw)
    assert r.usage.prompt_tokens == len(smollm2_tokenizer.encode("1, 2, 3,"))
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_is_not_shown(server, client):
    r = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == " 4,"


def test_generate_native(server, smollm2_tokenizer):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    out = httpx.post(server + "/generate", json=body, timeout=60).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 6
    assert out["meta_info"]["prompt_tokens"] == len(smollm2_tokenizer.encode(body["text"]))
    assert out["text"] == smollm2_tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    with httpx.stream("POST", server + "/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert len(chunks) > 1 and chunks[-1]["text"] == out["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert httpx.get(server + "/health_generate", timeout=60).status_code == 200


def _long_prompt(words: int) -> str:
    return "hello " * words


BAD = [
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', "Malformed JSON"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "n": 0}, "n must be in [1, 128], got 0"),
    ("/v1/completions", {"model": "smollm2", "prompt": _long_prompt(9000)}, "longer than the model's context length"),
    ("/v1/completions", {"model": "smollm2", "prompt": _long_prompt(5000)}, "KV cache pool"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 2}}, "top_p"),
]


def test_bad_input_is_400_while_a_good_request_completes(server):
    good = {}

    def run_good():
        body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
        good["resp"] = httpx.post(server + "/generate", json=body, timeout=120)

    th = threading.Thread(target=run_good)
    th.start()
    for path, body, msg in BAD:
        kw = ({"content": body, "headers": {"content-type": "application/json"}}
              if isinstance(body, bytes) else {"json": body})
        r = httpx.post(server + path, timeout=30, **kw)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert msg in err["message"], (path, err)
        assert err["code"] == 400 and err["type"] == "BadRequestError"
    th.join(timeout=120)
    assert good["resp"].status_code == 200
    assert good["resp"].json()["meta_info"]["completion_tokens"] == 16


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=-1)


def _wait_for_abort(server, aborted_before: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    info = {}
    while time.time() < deadline:
        info = _server_info(server)
        if info["num_aborted_requests"] > aborted_before and info["num_inflight_requests"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the request was not aborted: {info}")


def test_streaming_client_disconnect_aborts(server):
    before = _server_info(server)["num_aborted_requests"]
    body = {"text": "Write a very long essay.", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        first = next(ln for ln in r.iter_lines() if ln)
        assert first.startswith("data: ")
    _wait_for_abort(server, before)
    t0 = time.time()
    r = httpx.post(server + "/generate", timeout=60,
                   json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    assert time.time() - t0 < 30


def test_non_streaming_client_disconnect_aborts(server):
    before = _server_info(server)["num_aborted_requests"]
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait_for_abort(server, before)
    assert httpx.get(server + "/health", timeout=10).status_code == 200


# ---- SGLang's admin/info endpoints ------------------------------------------------------
ADMIN_ABORT = "Request aborted by an administrator (/abort_request)."


def test_server_and_model_info(server):
    info = _server_info(server)
    assert info["version"] == importlib.metadata.version("gramsync")
    # the effective ServerArgs (keys masked), then the schedulers' numbers
    assert info["grammar_backend"] == "xgrammar" and info["served_model_name"] == "smollm2"
    assert info["max_total_tokens"] == 4096 and info["api_key"] is None and info["admin_api_key"] is None
    assert info["context_len"] > 0 and info["num_inflight_requests"] >= 0
    model = httpx.get(server + "/get_model_info", timeout=10).json()
    assert model == {"model_path": info["model_path"], "tokenizer_path": info["model_path"],
                     "is_generation": True, "served_model_name": "smollm2",
                     "preferred_sampling_params": None, "weight_version": "default"}


def _rest_of_stream(server, body: dict, abort: dict) -> list[str]:
    """Start a native stream, abort it with ``abort`` once it runs; its remaining lines."""
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln).startswith("data: ")
        a = httpx.post(server + "/abort_request", json=abort, timeout=30)
        assert a.status_code == 200 and body["rid"] in a.json()["aborted"], a.text
        return [ln for ln in lines if ln]


def test_abort_request_ends_running_streams_with_the_abort_message(server, client):
    # an OpenAI stream, aborted by its response id (chatcmpl-<rid>), ends with finish reason
    # abort (SGLang's answer; no error event)
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2000, stream=True,
                                            extra_body={"ignore_eos": True})
    first = next(iter(stream))
    a = httpx.post(server + "/abort_request", json={"rid": first.id, "abort_all": False}, timeout=30)
    assert a.status_code == 200 and a.json() == {"aborted": [first.id.removeprefix("chatcmpl-")]}
    assert [c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason] == ["abort"]
    # a native stream, by rid (SGLang's body) and by abort_all: the last event says why
    for abort in ({"rid": "{rid}", "abort_all": False}, {"rid": "", "abort_all": True}):
        rid = "abort-" + uuid.uuid4().hex
        body = {"text": "Write a very long essay.", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        rest = _rest_of_stream(server, body, {**abort, "rid": abort["rid"].format(rid=rid)})
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))["meta_info"]
        assert last["finish_reason"]["type"] == "abort" and last["finish_reason"]["message"] == ADMIN_ABORT
        assert last["completion_tokens"] < 2000
    # gone: aborting it again is a 404 naming the id
    r = httpx.post(server + "/abort_request", json={"rid": rid}, timeout=30)
    assert r.status_code == 404 and rid in r.json()["error"]["message"]


def test_frontend_serves_on_uvloop(server):
    """The real server's frontend runs uvicorn on uvloop's event loop (the dependency that
    cuts its CPU per streamed chunk), not asyncio's."""
    import psutil

    httpx.get(server + "/health", timeout=10)  # the session's server is up
    frontends = [p for p in psutil.Process().children(recursive=True)
                 if (p.cmdline() or [""])[0].startswith("gramsync::frontend")]
    assert frontends, "no gramsync::frontend process under this test session"
    for p in frontends:
        with open(f"/proc/{p.pid}/maps") as f:
            assert "uvloop" in f.read(), p.cmdline()[0]
