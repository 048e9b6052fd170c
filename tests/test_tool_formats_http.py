"""Every --tool-call-parser format end to end through the official ``openai`` client: a real
server per format (the suite's tiny random-weight model with SmolLM2's tokenizer, whose
template has no tools, so the prompt teaches the format as text; greedy). The grammar makes
a random model's calls valid (pythonic's only approximates: a call that breaks its schema
is never reported as one), which is what is checked: required with n = 2, stream vs
non-stream giving the same calls, named, parallel_tool_calls false, history sent back in the
format, pythonic's strict 400; and TP=2 for one format of each argument style."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import _launch_server
from test_tool_calls_http import _client, _stream
from srt.function_call.formats import TOOL_CALL_PARSERS

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"enum": ["c", "f"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["n"]}}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
# max_tokens: SmolLM2 spells DeepSeek's markers in ~15 byte tokens each, and a random model pads
# its JSON with whitespace up to --constrained-json-max-whitespace.
BASE = {"model": "smollm2", "temperature": 0, "max_tokens": 120, "tools": [WEATHER, PING]}
SCHEMAS = {"get_weather": PARAMS, "ping": PING["function"]["parameters"]}
FORMATS = sorted(set(f.name for f in TOOL_CALL_PARSERS.values()))
TP2_FORMATS = ["qwen3_coder", "mistral", "pythonic"]  # one per argument style / wrapper shape


def _valid(call) -> tuple[str, dict]:
    assert call.type == "function" and call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, args


def _one_call(name: str, choice) -> list:
    """The choice's valid call (as (name, args)), or [] where the grammar only approximates
    the schema (pythonic: names and types) and the call broke it: then it must not be
    reported as a call at all, and the violation says why."""
    if name == "pythonic" and choice.finish_reason == "schema_violation":
        assert not choice.message.tool_calls and choice.model_extra["schema_violation"]["part"] in SCHEMAS
        return []
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (name, choice)
    return [_valid(choice.message.tool_calls[0])]


def _streamed(client, **kwargs) -> tuple[str, list, str]:
    content, calls, reason, _ = _stream(client, **kwargs)
    assert all(i and n for i, n, _ in calls.values())  # each call's first delta: its id and name
    return content, [(n, json.loads(a)) for _, n, a in calls.values()], reason


def _required_single_calls(name: str, client) -> tuple[dict, object, list]:
    """tool_choice required, one call: n = 2 choices each a valid call (or, for pythonic, a
    refused one), and the stream giving the first choice's call. (params, reply, call)."""
    one = {**BASE, "max_tokens": 250, "tool_choice": "required", "parallel_tool_calls": False}
    reply = client.chat.completions.create(messages=ASK, n=2, **one)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        _one_call(name, choice)
        if name in ("mistral", "mistral_v11"):  # the ids its templates require
            assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    whole = _one_call(name, reply.choices[0])
    content, streamed, reason = _streamed(client, messages=ASK, **one)
    assert streamed == whole and reason == ("tool_calls" if whole else "schema_violation"), (name, content)
    assert bool(content.strip()) == (not whole)  # a broken call's text is content, as unstreamed
    return one, reply, whole


@pytest.fixture(scope="module", params=FORMATS)
def format_server(request, tmp_path_factory, tiny_dir):
    for base in _launch_server(tmp_path_factory, tiny_dir, ["--tool-call-parser", request.param,
                                                             "--dtype", "float32"]):
        yield request.param, base


@pytest.mark.timeout(300)
def test_every_format_required_named_parallel_stream_and_history(format_server):
    name, base = format_server
    client = _client(base)
    one, reply, _ = _required_single_calls(name, client)

    named = client.chat.completions.create(messages=ASK, **{**one, "tool_choice": {
        "type": "function", "function": {"name": "ping"}}})
    assert [c[0] for c in _one_call(name, named.choices[0])] in (["ping"], [])
    many = client.chat.completions.create(messages=ASK, tool_choice="required", **BASE)
    choice = many.choices[0]  # a random model may call until max_tokens: every whole call counts
    if choice.finish_reason != "schema_violation":
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
        assert all(_valid(c) for c in choice.message.tool_calls)

    calls = reply.choices[0].message.tool_calls or named.choices[0].message.tool_calls or []
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    again = client.chat.completions.create(messages=history, **one)
    _one_call(name, again.choices[0])
    if name == "pythonic":  # its grammar is never exact: a strict tool is a 400 before any byte
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="pythonic"):
                r = client.chat.completions.create(messages=ASK, **{**one, "tools": [strict]}, stream=stream)
                list(r) if stream else None


@pytest.fixture(scope="module", params=TP2_FORMATS)
def tp2_format_server(request, tmp_path_factory, tiny_dir):
    for base in _launch_server(tmp_path_factory, tiny_dir, ["--tool-call-parser", request.param,
                                                             "--tp-size", "2", "--dtype", "float32"]):
        yield request.param, base


@pytest.mark.timeout(300)
def test_tp2_calls_validate_and_stream_the_same(tp2_format_server):
    name, base = tp2_format_server
    _required_single_calls(name, _client(base))
