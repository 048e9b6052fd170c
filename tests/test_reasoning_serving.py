"""Thinking with structured outputs through the real scheduler (in process) and a real
server, on the tiny model's thinking twin (tests/tiny_model.py: ``</think>`` is one token, the
template opens the think block). Its random weights never close the thinking by themselves,
so ``thinking_budget`` does: the output thinks exactly N tokens, then ``</think>``, then the
constrained answer."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import _launch_server
from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import TokenizedGenerateReq
from test_scheduler import make_scheduler, run_until_done

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
       "triggers": ["<f>"]}
CONSTRAINTS = {"json_schema": json.dumps(SCHEMA), "regex": "[0-9]{3}", "structural_tag": json.dumps(TAG)}
BUDGET = 6


@pytest.fixture(scope="module")
def tok(tiny_think_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_think_dir)


def _prompt(tok, thinking: bool = True) -> tuple[int, ...]:
    return tuple(tok.apply_chat_template([{"role": "user", "content": "A number."}], add_generation_prompt=True,
                                         enable_thinking=thinking, tokenize=True, return_dict=False))


def _req(tok, rid: str, params: dict, reasoning: bool = True) -> TokenizedGenerateReq:
    p = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 40, "thinking_budget": BUDGET, **params})
    return TokenizedGenerateReq(rid, _prompt(tok, reasoning), p, False, require_reasoning=reasoning)


def _check_answer(kind: str, answer: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(answer), SCHEMA)
    elif kind == "regex":
        assert len(answer) == 3 and answer.isdigit()
    elif "<f>" in answer:  # structural tag: free text, any call valid
        jsonschema.validate(json.loads(answer.split("<f>", 1)[1].split("</f>", 1)[0]), SCHEMA)


def _run(tiny_think_dir, tok, reqs, **kw):
    s = make_scheduler(tiny_think_dir, tok, max_total_tokens=4096, disable_torch_compile=True,
                       reasoning_parser="qwen3.5", **kw)
    try:
        return run_until_done(s, {0: reqs})
    finally:
        s.grammar_manager.backend.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constraint_starts_after_exactly_budget_thinking_tokens(tiny_think_dir, tok, backend):
    think_end = tok.convert_tokens_to_ids("</think>")
    reqs = [_req(tok, kind, {kind: spec}) for kind, spec in CONSTRAINTS.items()]
    reqs += [_req(tok, "zero", {"regex": "[0-9]{3}", "thinking_budget": 0}),
             _req(tok, "free", {"max_new_tokens": 12, "ignore_eos": True}),  # a budget and no constraint
             _req(tok, "off", {"json_schema": json.dumps(SCHEMA)}, reasoning=False)]  # enable_thinking false
    outs = _run(tiny_think_dir, tok, reqs, grammar_backend=backend)
    for kind in CONSTRAINTS:
        ids = outs[kind]["ids"]
        assert ids.index(think_end) == BUDGET, kind
        _check_answer(kind, tok.decode(ids[BUDGET + 1:], skip_special_tokens=True))
    assert outs["zero"]["ids"][0] == think_end
    assert outs["free"]["ids"].index(think_end) == BUDGET and len(outs["free"]["ids"]) == 12
    assert think_end not in outs["off"]["ids"]  # thinking off: the schema binds from the first token
    _check_answer("json_schema", tok.decode(outs["off"]["ids"], skip_special_tokens=True))


def test_speculation_and_fast_forward_give_the_same_tokens(tiny_think_dir, tok):
    # NGRAM drafts walk through the thinking and across the think end (rolled back exactly).
    reqs = lambda: [_req(tok, kind, {kind: spec}) for kind, spec in CONSTRAINTS.items()]  # noqa: E731
    plain = _run(tiny_think_dir, tok, reqs(), grammar_backend="xgrammar", disable_grammar_fast_forward=True)
    spec = _run(tiny_think_dir, tok, reqs(), grammar_backend="xgrammar", speculative_algorithm="NGRAM")
    assert {r: o["ids"] for r, o in spec.items()} == {r: o["ids"] for r, o in plain.items()}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "A number."}], "temperature": 0,
        "max_tokens": 40, "thinking_budget": BUDGET,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}


def _streamed(client, body) -> dict[int, dict]:
    got: dict[int, dict] = {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                c = got.setdefault(ch["index"], {"reasoning_content": "", "content": ""})
                for key in ("reasoning_content", "content"):
                    c[key] += ch["delta"].get(key) or ""
    return got


def _chat_checks(client) -> list:
    """What a thinking server answers; returns the outputs to compare across TP sizes."""
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    seen = []
    for choice in r["choices"]:
        m = choice["message"]
        jsonschema.validate(json.loads(m["content"]), SCHEMA)  # the answer: the document
        assert m["reasoning_content"] and "</think>" not in m["reasoning_content"]
        assert m["content"] not in m["reasoning_content"]  # never the constrained JSON (vLLM #50948)
        seen.append((m["reasoning_content"], m["content"]))
    streamed = _streamed(client, {**CHAT, "n": 2})
    assert [(streamed[i]["reasoning_content"], streamed[i]["content"]) for i in range(2)] == seen
    off = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}}).json()
    msg = off["choices"][0]["message"]
    assert "reasoning_content" not in msg  # SGLang #9282: thinking off still constrains
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    kept = client.post("/v1/chat/completions", json={**CHAT, "separate_reasoning": False}).json()["choices"][0]
    assert "reasoning_content" not in kept["message"]  # the text as generated, all in content
    assert kept["message"]["content"].startswith(seen[0][0] + "</think>") and kept["message"]["content"].endswith(seen[0][1])
    regex = client.post("/v1/chat/completions", json={**{k: v for k, v in CHAT.items() if k != "response_format"},
                                                      "regex": "[0-9]{3}"}).json()["choices"][0]["message"]
    assert len(regex["content"]) == 3 and regex["content"].isdigit() and regex["reasoning_content"]
    native = client.post("/generate", json={"text": "Hi", "require_reasoning": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 20, "thinking_budget": 3, "regex": "[0-9]{3}"}}).json()
    assert native["text"].split("</think>")[1].isdigit()
    for bad, why in ((-1, "thinking_budget"), ("2", "thinking_budget")):
        err = client.post("/v1/chat/completions", json={**CHAT, "thinking_budget": bad})
        assert err.status_code == 400 and why in err.json()["error"]["message"]
    return [seen, native["output_ids"]]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory, tiny_think_dir):
    yield from _launch_server(tmp_path_factory, tiny_think_dir, ["--reasoning-parser", "qwen3.5", "--dtype", "float32"])


def test_chat_splits_reasoning_and_constrains_the_answer(think_server):
    with httpx.Client(base_url=think_server, timeout=120) as client:
        _chat_checks(client)


def test_tp2_gives_what_tp1_gives(tmp_path_factory, tiny_think_dir, think_server):
    with httpx.Client(base_url=think_server, timeout=120) as client:
        want = _chat_checks(client)
    args = ["--reasoning-parser", "qwen3.5", "--dtype", "float32", "--tp-size", "2"]
    for base in _launch_server(tmp_path_factory, tiny_think_dir, args):
        with httpx.Client(base_url=base, timeout=120) as client:
            assert _chat_checks(client) == want



TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}


def test_tool_calls_after_thinking_stream_and_not(think_server):
    """Tools with a thinking model (vLLM #46149): the call is constrained after </think>, the
    thinking is reasoning_content and never holds the call, stream and non-stream agree."""
    body = {**{k: v for k, v in CHAT.items() if k != "response_format"}, "tools": [TOOL],
            "tool_choice": "required", "parallel_tool_calls": False, "thinking_budget": 3, "max_tokens": 120}
    with httpx.Client(base_url=think_server, timeout=120) as client:
        r = client.post("/v1/chat/completions", json={**body, "n": 2}).json()
        calls = []
        for choice in r["choices"]:
            m = choice["message"]
            assert choice["finish_reason"] == "tool_calls" and len(m["tool_calls"]) == 1, choice
            args = json.loads(m["tool_calls"][0]["function"]["arguments"])
            jsonschema.validate(args, TOOL["function"]["parameters"])
            assert m["reasoning_content"] and "<tool_call>" not in m["reasoning_content"] and not m["content"]
            calls.append((m["reasoning_content"], m["tool_calls"][0]["function"]["arguments"]))
        streamed, call_args = {"reasoning_content": ""}, ""
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        streamed["reasoning_content"] += ch["delta"].get("reasoning_content") or ""
                        for d in ch["delta"].get("tool_calls") or []:
                            call_args += d["function"].get("arguments") or ""
        assert (streamed["reasoning_content"], call_args) == calls[0]
