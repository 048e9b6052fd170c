"""What SGLang's own clients send, and how aborted requests are answered (issue 58), on the
session's shared real server (``server`` in conftest.py: fp32, xgrammar), through httpx
for the native API and the official ``openai`` client for the OpenAI one.

- SGLang's default no-op fields (``return_logprob: false`` with ``top_logprobs_num: 0`` and
  ``logprob_start_len: 0``, ``spaces_between_special_tokens: true``, ``lora_path: null``,
  ...) are accepted, constraints included; a value asking for a missing feature is a 400.
- An administrator's abort (/abort_request, by rid and abort_all) answers 200 with the
  partial output and finish reason ``abort`` on every path: native, chat, completions,
  streamed or not, ``n`` > 1, batches (timeouts: test_multi_rank_timeouts.py).
- Batched /generate: in order, each item as it is alone, streams with ``index``.
- ``echo`` with ``n`` > 1, ``continue_final_message``, ``GET /v1/models/{id}``.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
import uuid

import httpx
import openai
import pytest

from srt.tokenizer_utils import apply_chat_template

pytestmark = pytest.mark.timeout(240)

ADMIN_ABORT = "Request aborted by an administrator (/abort_request)."
# Long enough to be cut off, short enough that every request of a test runs at once: the
# scheduler admits a request only while the 4096-token KV pool holds every admitted
# request's whole budget (SGLang's rule), so 2000-token requests would queue.
LONG = {"max_new_tokens": 300, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Write a long poem about the sea."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)


def _generate(server, body: dict) -> httpx.Response:
    return httpx.post(server + "/generate", json=body, timeout=120)


# ---- 1. SGLang's default fields --------------------------------------------------------
# What SGLang's RuntimeEndpoint.generate sends (sglang/lang/backend/runtime_endpoint.py):
# its sampling defaults (SglSamplingParams.to_srt_kwargs) and the four logprob fields.
def _runtime_endpoint_body(text: str, **constraint) -> dict:
    sp = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
          "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": None,
          "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
    sp.update(constraint)
    return {"text": text, "sampling_params": sp, "return_logprob": False, "logprob_start_len": 0,
            "top_logprobs_num": 0, "return_text_in_logprobs": False}


def test_sglang_clients_default_fields_are_accepted_with_constraints(server):
    r = _generate(server, {"text": "Hi", "sampling_params": {"max_new_tokens": 4}, "logprob_start_len": 0})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
    assert "input_token_logprobs" not in r.json()["meta_info"]  # nothing asked: none returned
    plain = _generate(server, _runtime_endpoint_body("The answer is"))
    assert plain.status_code == 200, plain.text
    regex = _generate(server, _runtime_endpoint_body("The answer is", regex="[0-9]{3}"))
    assert regex.status_code == 200 and re.fullmatch("[0-9]{3}", regex.json()["text"]), regex.text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = _runtime_endpoint_body("JSON:", json_schema=json.dumps(schema))
    body["sampling_params"]["max_new_tokens"] = 32
    doc = _generate(server, body)
    assert doc.status_code == 200 and isinstance(json.loads(doc.json()["text"])["n"], int), doc.text
    ebnf = _runtime_endpoint_body("Yes or no?", ebnf='root ::= "yes" | "no"', regex=None)
    answer = _generate(server, ebnf)
    assert answer.status_code == 200 and answer.json()["text"] in ("yes", "no"), answer.text
    # Other clients' no-op defaults, top level and in sampling_params; sampling_seed = seed.
    extra = {"lora_path": None, "image_data": None, "return_hidden_states": False, "log_metrics": True,
             "stream": False, "custom_logit_processor": None, "modalities": [], "session_params": None}
    seeded = {"max_new_tokens": 6, "temperature": 1.0, "no_stop_trim": False, "stream_interval": None}
    a = _generate(server, {"text": "Once", **extra, "sampling_params": {**seeded, "sampling_seed": 7}})
    b = _generate(server, {"text": "Once", "sampling_params": {**seeded, "seed": 7}})
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["output_ids"] == b.json()["output_ids"]


def test_logprob_fields_that_ask_for_something_are_refused_or_served(server):
    r = _generate(server, {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": 2})
    assert r.status_code == 400 and "return_logprob" in r.json()["error"]["message"], r.text
    on = _generate(server, {"text": "Hi there", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                            "logprob_start_len": 0, "top_logprobs_num": 2})
    meta = on.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 2 and len(meta["input_token_logprobs"]) == 2
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


@pytest.mark.parametrize("field, value, where", [
    ("image_data", "cat.png", "top"), ("lora_path", "adapter-1", "top"), ("return_hidden_states", True, "top"),
    ("session_params", {"id": "s"}, "top"), ("token_ids_logprob", [1, 2], "top"),
    ("no_stop_trim", True, "sampling_params"), ("stop_regex", "\\d", "sampling_params"),
    ("spaces_between_special_tokens", False, "sampling_params")])
def test_fields_asking_for_a_missing_feature_are_refused_by_name(server, field, value, where):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    (body if where == "top" else body["sampling_params"])[field] = value
    r = _generate(server, body)
    assert r.status_code == 400, r.text
    assert f"{field} is not supported by this server" in r.json()["error"]["message"], r.text


# ---- 2. an administrator's abort: 200 with the partial output ----------------------------
def _wait_running(server, rids: list[str], timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:  # running = it has produced a token (not just queued)
        if httpx.get(server + "/get_server_info", timeout=10).json()["num_inflight_requests"] >= len(rids):
            time.sleep(1.0)  # a few decode steps
            return
        time.sleep(0.05)
    pytest.fail(f"{rids} never ran")


def _abort(server, body: dict) -> list[str]:
    a = httpx.post(server + "/abort_request", json=body, timeout=30)
    assert a.status_code == 200, a.text
    return a.json()["aborted"]


def _assert_admin_abort(meta: dict) -> None:
    fr = meta["finish_reason"]
    assert fr["type"] == "abort" and fr["message"] == ADMIN_ABORT and fr["status_code"] == 200, fr
    assert meta["completion_tokens"] < LONG["max_new_tokens"]


def test_admin_abort_of_non_streaming_native_requests_answers_the_partial_output(server):
    with cf.ThreadPoolExecutor(3) as pool:
        one = pool.submit(_generate, server, {"text": "Tell a story.", "rid": "abort-one", "sampling_params": LONG})
        many = pool.submit(_generate, server, {"text": "Tell a story.", "rid": "abort-n",
                                               "sampling_params": {**LONG, "n": 2, "seed": 1}})
        batch = pool.submit(_generate, server, {"text": ["Tell a story.", "Count:"], "rid": "abort-b",
                                                "sampling_params": LONG})
        _wait_running(server, ["abort-one", "abort-n-0", "abort-n-1", "abort-b_0", "abort-b_1"])
        assert _abort(server, {"rid": "abort-one", "abort_all": False}) == ["abort-one"]
        r = one.result()
        assert r.status_code == 200, r.text
        _assert_admin_abort(r.json()["meta_info"])
        assert r.json()["meta_info"]["completion_tokens"] > 0 and r.json()["text"]  # it ran: partial text
        assert r.json()["meta_info"]["completion_tokens"] == len(r.json()["output_ids"])
        assert set(_abort(server, {"abort_all": True})) == {"abort-n-0", "abort-n-1", "abort-b_0", "abort-b_1"}
        n, b = many.result(), batch.result()
    assert n.status_code == 200 and [o["index"] for o in n.json()] == [0, 1], n.text
    assert b.status_code == 200 and [o["meta_info"]["id"] for o in b.json()] == ["abort-b_0", "abort-b_1"], b.text
    for out in n.json() + b.json():
        _assert_admin_abort(out["meta_info"])


def test_admin_abort_of_openai_requests_answers_finish_reason_abort(server, client):
    def chat(**kw):
        return client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=300,
                                              extra_body={"ignore_eos": True}, **kw)

    def completion(prompt="Once upon a time"):
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=300,
                                         extra_body={"ignore_eos": True})

    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(chat), pool.submit(chat, n=2, seed=3), pool.submit(completion),
                pool.submit(completion, prompt=["a", "b"])]
        _wait_running(server, ["chat", "chat-0", "chat-1", "cmpl", "b0", "b1"])
        assert len(_abort(server, {"abort_all": True})) == 6
        one, two, cmpl, batch = [f.result() for f in futs]
    assert [c.finish_reason for c in one.choices + two.choices] == ["abort"] * 3
    assert one.choices[0].message.content and one.usage.completion_tokens > 0  # the partial reply
    assert [c.finish_reason for c in cmpl.choices + batch.choices] == ["abort"] * 3
    assert cmpl.choices[0].text and [c.index for c in batch.choices] == [0, 1]


def test_admin_abort_ends_streams_with_finish_reason_abort(server, client):
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=300, stream=True,
                                            n=2, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert _abort(server, {"rid": first.id}) == [first.id.removeprefix("chatcmpl-")]
    reasons = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
    assert reasons == {0: "abort", 1: "abort"}  # no exception: an ordinary end
    stream = client.completions.create(model="smollm2", prompt="Once", max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert _abort(server, {"abort_all": True}) == [first.id.removeprefix("cmpl-")]
    assert [c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason] == ["abort"]
    # native, a batch: each item's last event says abort
    body = {"text": ["Tell a story.", "Count:"], "rid": "sabort", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        lines = (ln for ln in r.iter_lines() if ln)
        assert next(lines).startswith("data: ")
        assert sorted(_abort(server, {"abort_all": True})) == ["sabort_0", "sabort_1"]
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    finals = [json.loads(ln[6:]) for ln in rest[:-1] if json.loads(ln[6:])["meta_info"]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    for f in finals:
        _assert_admin_abort(f["meta_info"])


# ---- 3. batched /generate ----------------------------------------------------------------
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def test_batched_generate_is_each_prompt_alone_in_order(server, smollm2_tokenizer):
    texts = ["The capital of France is", "1, 2, 3,", "Hello"]
    alone = [_generate(server, {"text": t, "sampling_params": GREEDY}).json() for t in texts]
    r = _generate(server, {"text": texts, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [a["output_ids"] for a in alone]
    assert [o["index"] for o in r.json()] == [0, 1, 2]
    ids = [smollm2_tokenizer.encode(t) for t in texts]
    per_item = [GREEDY, {**GREEDY, "max_new_tokens": 2}, {**GREEDY, "n": 2}]
    r = _generate(server, {"input_ids": ids, "sampling_params": per_item, "rid": ["x0", "x1", "x2"]})
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["x0", "x1", "x2-0", "x2-1"]  # prompt k's samples together
    assert outs[0]["output_ids"] == alone[0]["output_ids"]
    assert outs[1]["output_ids"] == alone[1]["output_ids"][:2]
    assert outs[2]["output_ids"] == outs[3]["output_ids"] == alone[2]["output_ids"]  # greedy samples agree
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    # per-prompt logprob fields
    r = _generate(server, {"text": texts[:2], "sampling_params": {"max_new_tokens": 1},
                           "return_logprob": [True, False]})
    assert "output_token_logprobs" in r.json()[0]["meta_info"]
    assert "output_token_logprobs" not in r.json()[1]["meta_info"]


def test_batched_stream_carries_each_items_index(server):
    texts = ["The capital of France is", "1, 2, 3,"]
    whole = _generate(server, {"text": texts, "sampling_params": {**GREEDY, "n": 2}}).json()
    body = {"text": texts, "sampling_params": {**GREEDY, "n": 2}, "stream": True}
    last: dict[int, dict] = {}
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                out = json.loads(ln[6:])
                last[out["index"]] = out
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["text"] for i in range(4)] == [o["text"] for o in whole]


def test_a_bad_batch_item_is_a_400_naming_it_and_runs_nothing(server):
    before = httpx.get(server + "/get_server_info", timeout=10).json()["num_inflight_requests"]
    cases = [({"text": ["Hi", ""]}, "Batch item 1: The input is empty"),
             ({"text": ["Hi", "Ho"], "sampling_params": [GREEDY]}, "sampling_params is a list of 1 values"),
             ({"text": []}, "text is an empty list"),
             ({"text": ["Hi", "Ho"], "rid": ["same", "same"]}, "repeats another item's"),
             ({"input_ids": [[1, 2], [10**9]]}, "Batch item 1: input_ids must be in"),
             ({"text": "Hi", "rid": ["a"]}, "rid is a list, but the request has one prompt")]
    for body, message in cases:
        r = _generate(server, {"sampling_params": GREEDY, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert httpx.get(server + "/get_server_info", timeout=10).json()["num_inflight_requests"] == before


def test_aborting_one_batch_item_leaves_the_others(server):
    body = {"text": ["Tell a story.", "Count:"], "rid": ["keep", "drop"],
            "sampling_params": [{"max_new_tokens": 40, "ignore_eos": True}, LONG]}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_generate, server, body)
        _wait_running(server, ["keep", "drop"])
        assert _abort(server, {"rid": "drop"}) == ["drop"]
        r = fut.result()
    assert r.status_code == 200, r.text
    keep, drop = r.json()
    assert keep["meta_info"]["finish_reason"]["type"] == "length" and keep["meta_info"]["completion_tokens"] == 40
    _assert_admin_abort(drop["meta_info"])


# ---- 4. smaller gaps ---------------------------------------------------------------------
def test_echo_with_n_choices(server, client):
    prompt = "The capital of France is"
    one = client.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1, max_tokens=4,
                                    temperature=0)
    many = client.completions.create(model="smollm2", prompt=[prompt, "1, 2,"], echo=True, logprobs=1,
                                     max_tokens=4, temperature=0.8, seed=5, n=3)
    assert [c.index for c in many.choices] == list(range(6))
    n_prompt = len(one.choices[0].logprobs.tokens) - 4
    for c in many.choices[:3]:
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp.tokens[:n_prompt] == one.choices[0].logprobs.tokens[:n_prompt]
        assert lp.token_logprobs[1:n_prompt] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:n_prompt],
                                                              abs=1e-4)
    assert all(c.text.startswith("1, 2,") for c in many.choices[3:])
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="smollm2", prompt=[prompt, "1, 2,"], echo=True, max_tokens=4,
                                           temperature=0.8, seed=5, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [c.text for c in many.choices]  # same seeds, same choices


def test_continue_final_message(server, client, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    ids = apply_chat_template(smollm2_tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert smollm2_tokenizer.decode(ids).endswith("My favourite is")  # the open message, no end token
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True})
    native = _generate(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert r.choices[0].message.content == native.json()["text"]
    assert r.usage.prompt_tokens == len(ids)
    refused = [({"messages": messages[:1]}, "needs the last message to be the assistant's"),
               ({"add_generation_prompt": True}, "cannot both be true"),
               ({"response_format": {"type": "json_object"}}, "cannot be combined with tools or a constraint")]
    for extra, message in refused:
        body = {"model": "smollm2", "messages": messages, "max_tokens": 2, "continue_final_message": True, **extra}
        bad = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text


def test_retrieve_a_model(server, client):
    card = client.models.retrieve("smollm2")
    assert card.id == "smollm2" and card.id == client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("meta-llama/" + uuid.uuid4().hex)


def test_openai_fields_without_effect_are_accepted_and_others_refused(server, client):
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, user="u", store=False,
                                       extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
    assert r.choices[0].finish_reason == "length"
    for field, value in (("reasoning_effort", "high"), ("verbosity", "low"), ("functions", [{"name": "f"}])):
        body = {"model": "smollm2", "messages": CHAT, "max_tokens": 2, field: value}
        bad = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
        assert bad.status_code == 400 and f"{field} is not supported" in bad.json()["error"]["message"], bad.text
