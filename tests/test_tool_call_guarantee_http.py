"""A reported success is valid, for tool calls and structural tags too (docs/tools.md,
"Structured outputs"): through the official ``openai`` client against the shared session
servers (default backend ``auto``; embedded SmolLM2, greedy), at TP=1 and TP=2.

For tools whose ``parameters`` use each keyword a grammar library drops, every answer is
checked with python-jsonschema: ``finish_reason: "tool_calls"`` only with calls that
validate; otherwise ``"schema_violation"``, no ``tool_calls``, and the violation names the
tool, the keyword and the path. ``function.strict`` is exact or a 400 naming the tool,
the keyword and the path, also with ``stream: true`` (before any byte). The schema
``NEVER`` admits no document at all (``not`` of its own type), so every completed call of it
is a violation: the path that reports violations is always exercised.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from test_tag_guarantee import KEYWORD_SCHEMAS

NEVER = {"type": "object", "properties": {"word": {"type": "string", "not": {"type": "string"}}},
         "required": ["word"]}
ASK = [{"role": "user", "content": "Give me a word and some values."}]
GREEDY = {"model": "smollm2", "temperature": 0, "max_tokens": 60}
EXACT_IN_LLGUIDANCE = ("allOf", "multipleOf", "format")  # strict is served (README table)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=180, max_retries=0)


def _tool(name: str, params: dict, strict: bool = False) -> dict:
    return {"type": "function", "function": {"name": name, "strict": strict, "parameters": params}}


def _is_valid(schema: dict, args) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(args)


def _documents(content: str, schemas: dict) -> dict:
    """{tool name: [arguments, ...]} of the completed calls written in ``content``."""
    out: dict = {}
    decoder = json.JSONDecoder()
    for name in schemas:
        begin = f'<tool_call>\n{{"name": "{name}", "arguments": '
        at = content.find(begin)
        while at >= 0:
            try:
                args, _ = decoder.raw_decode(content, at + len(begin))
                out.setdefault(name, []).append(args)
            except json.JSONDecodeError:
                pass  # a call cut by max_tokens
            at = content.find(begin, at + 1)
    return out


def _check_choice(finish_reason: str, calls: list[tuple[str, str]], content, violation, schemas: dict) -> None:
    """The guarantee for one choice: (name, arguments) calls, content, schema_violation."""
    if finish_reason == "schema_violation":
        assert not calls, "a call that broke its schema was returned as a call"
        assert violation["part"] in schemas and violation["keyword"] and violation["path"].startswith("#")
        broken = _documents(content or "", schemas)[violation["part"]]
        assert any(not _is_valid(schemas[violation["part"]], args) for args in broken)
        return
    assert violation is None
    for name, arguments in calls:
        assert _is_valid(schemas[name], json.loads(arguments)), (name, arguments)
    if finish_reason == "tool_calls":
        assert calls


def _stream(client, **kwargs) -> dict:
    """Per choice index: (finish_reason, [(name, arguments)], content, schema_violation)."""
    acc: dict = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            st = acc.setdefault(choice.index, {"reason": None, "calls": {}, "content": "", "violation": None})
            st["content"] += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                name, args = st["calls"].get(d.index, ("", ""))
                st["calls"][d.index] = (d.function.name or name, args + (d.function.arguments or ""))
            if choice.finish_reason:
                st["reason"] = choice.finish_reason
                st["violation"] = (choice.model_extra or {}).get("schema_violation")
    return {i: (st["reason"], [st["calls"][k] for k in sorted(st["calls"])], st["content"], st["violation"])
            for i, st in acc.items()}


def _final(client, **kwargs) -> list:
    reply = client.chat.completions.create(**kwargs)
    return [(c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
             c.message.content, (c.model_extra or {}).get("schema_violation")) for c in reply.choices]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keyword", sorted(KEYWORD_SCHEMAS))
def test_each_dropped_keyword_never_yields_an_invalid_call(server_auto, keyword):
    """Non-strict: served (approximately where need be); streamed and not, the same verdict."""
    client, name = _client(server_auto), f"f_{keyword}"
    schemas = {name: KEYWORD_SCHEMAS[keyword]}
    kwargs = dict(messages=ASK, tools=[_tool(name, schemas[name])], tool_choice="required", **GREEDY)
    (final,) = _final(client, **kwargs)
    _check_choice(*final, schemas)
    streamed = _stream(client, **kwargs)[0]
    _check_choice(*streamed, schemas)
    assert streamed[0] == final[0] and streamed[3] == final[3]
    if final[1]:
        assert [(n, json.loads(a)) for n, a in streamed[1]] == [(n, json.loads(a)) for n, a in final[1]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keyword", sorted(KEYWORD_SCHEMAS))
def test_strict_tool_is_exact_or_a_400_before_any_byte(server_auto, keyword):
    client, name = _client(server_auto), f"f_{keyword}"
    tools = [_tool("other", {"type": "object", "properties": {}}), _tool(name, KEYWORD_SCHEMAS[keyword], strict=True)]
    kwargs = dict(messages=ASK, tools=tools, tool_choice={"type": "function", "function": {"name": name}}, **GREEDY)
    if keyword in EXACT_IN_LLGUIDANCE:
        (final,) = _final(client, **kwargs)
        assert final[0] in ("tool_calls", "length", "schema_violation")  # format: validated too
        _check_choice(*final, {name: KEYWORD_SCHEMAS[keyword]})
        return
    for stream in (False, True):  # the status line is the 400: no role chunk first
        r = httpx.post(server_auto + "/v1/chat/completions", json={**kwargs, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools"
        assert f"tools[1] ({name}): function.strict" in err["message"]
        gap = {"if": "if at #", "oneOf": "oneOf at #/properties/v", "not": "not at #/properties/word",
               "uniqueItems": "uniqueItems at #/properties/t"}[keyword]
        assert gap in err["message"]


@pytest.mark.timeout(300)
def test_violation_reported_in_response_stream_n2_and_parallel_calls(server_auto):
    client = _client(server_auto)
    schemas = {"never": NEVER, "city": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                        "required": ["city"]}}
    tools = [_tool(n, s) for n, s in schemas.items()]
    named = dict(messages=ASK, tools=tools, tool_choice={"type": "function", "function": {"name": "never"}}, **GREEDY)
    finals = _final(client, n=2, **named)
    streams = _stream(client, n=2, **named)
    for i in range(2):
        for reason, calls, content, violation in (finals[i], streams[i]):
            assert reason == "schema_violation" and violation["part"] == "never" and violation["keyword"] == "not"
            assert violation["path"] == "#/word" and violation["schema_path"] == "#/properties/word/not"
            _check_choice(reason, calls, content, violation, schemas)
    both = dict(messages=[{"role": "user", "content": "Weather in Paris and London?"}], tools=tools,
                tool_choice="required", parallel_tool_calls=True, **{**GREEDY, "max_tokens": 120})
    for choice in (*_final(client, **both), _stream(client, **both)[0]):
        _check_choice(*choice, schemas)


@pytest.mark.timeout(300)
def test_user_structural_tag_parts_are_validated(server_auto):
    """A structural_tag's JSON part is validated like a tool call (native and OpenAI), and a
    json_schema outside a tag must be exact: else a 400 before any byte."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "content": {
        "type": "json_schema", "json_schema": NEVER}, "end": "</x>"}}
    r = httpx.post(server_auto + "/generate", timeout=120, json={
        "text": "Write a word in JSON: ", "sampling_params": {"structural_tag": tag, "temperature": 0,
                                                              "max_new_tokens": 40}}).json()
    fr = r["meta_info"]["finish_reason"]
    assert fr["type"] == "schema_violation" and fr["part"] == "tag 0" and fr["keyword"] == "not", r
    reply = _client(server_auto).chat.completions.create(messages=ASK, response_format=tag, **GREEDY)
    assert reply.choices[0].finish_reason == "schema_violation"
    outside = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A:"}, {"type": "json_schema", "json_schema": NEVER}]}}
    r = httpx.post(server_auto + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "response_format": outside, "stream": True, **GREEDY})
    assert r.status_code == 400 and "outside a tag" in r.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_strict_json_schema_streamed_is_a_400(server_auto):
    rf = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": KEYWORD_SCHEMAS["uniqueItems"]}}
    for stream in (False, True):
        r = httpx.post(server_auto + "/v1/chat/completions", timeout=60,
                       json={"messages": ASK, "response_format": rf, "stream": stream, **GREEDY})
        assert r.status_code == 400 and "uniqueItems at #/properties/t" in r.json()["error"]["message"]
    r = httpx.post(server_auto + "/generate", timeout=60, json={"text": "x", "stream": True, "sampling_params": {
        "json_schema": json.dumps(KEYWORD_SCHEMAS["uniqueItems"]), "json_schema_strict": True}})
    assert r.status_code == 400 and "uniqueItems" in r.text


@pytest.mark.timeout(120)
def test_deeply_nested_tool_call_arguments_are_a_400(server_auto):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "[" * 5000}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    r = httpx.post(server_auto + "/v1/chat/completions", timeout=60, json={
        "messages": history, "tools": [_tool("f", {"type": "object", "properties": {}})], **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "nested too deeply" in r.json()["error"]["message"]


@pytest.mark.timeout(400)
def test_tp2_tool_call_guarantee(tp2_server):
    base, _ = tp2_server
    client = _client(base)
    schemas = {"never": NEVER, "f_uniqueItems": KEYWORD_SCHEMAS["uniqueItems"]}
    tools = [_tool(n, s) for n, s in schemas.items()]
    named = dict(messages=ASK, tools=tools, tool_choice={"type": "function", "function": {"name": "never"}}, **GREEDY)
    for reason, calls, content, violation in (*_final(client, n=2, **named), _stream(client, **named)[0]):
        assert reason == "schema_violation" and violation["part"] == "never"
        _check_choice(reason, calls, content, violation, schemas)
    required = dict(messages=ASK, tools=tools[1:], tool_choice="required", **GREEDY)
    for choice in (*_final(client, **required), _stream(client, **required)[0]):
        _check_choice(*choice, schemas)
    strict = [_tool("never", NEVER, strict=True)]
    r = httpx.post(base + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "tools": strict, "tool_choice": "required", "stream": True, **GREEDY})
    assert r.status_code == 400 and "tools[0] (never): function.strict" in r.json()["error"]["message"]
