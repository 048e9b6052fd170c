"""Tool calling end to end with the official ``openai`` client against the shared session
servers (embedded SmolLM2, greedy): required, named and auto calls, streamed deltas that
reassemble into the same call, history with tool messages, and 400s naming the field.

SmolLM2 has no tool format of its own, so its prompt gets the default Hermes section;
in ``auto`` it prefers to answer in text, so the auto-call test nudges it towards the
trigger with a logit_bias on the tokens of "<tool_call>" (the grammar does the rest).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"model": "smollm2", "temperature": 0, "max_tokens": 64}


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)


def _trigger_bias(tokenizer) -> dict:
    """+30 on each token of "<tool_call>" (SmolLM2: <, tool, _, call, >)."""
    return {str(t): 30 for t in tokenizer.encode("<tool_call>")}


def _check_call(call, name: str = "get_weather", schema: dict = PARAMS) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def _stream(client, **kwargs):
    """(content, {index: (id, name, arguments)}, finish_reason, first tool delta) from a stream."""
    content, calls, reason, first = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                first = first or d
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments or ""
    return content, {i: tuple(c) for i, c in calls.items()}, reason, first


@pytest.mark.timeout(240)
def test_required_and_named_calls_validate(server):
    client = _client(server)
    r = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], choice.message.tool_calls[0].function.name,
                {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[
                    choice.message.tool_calls[0].function.name])
    r = client.chat.completions.create(messages=ASK, tools=TOOLS, parallel_tool_calls=False, **GREEDY,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], "get_time", TIME["function"]["parameters"])


@pytest.mark.timeout(240)
def test_auto_answers_in_text_or_calls_after_the_trigger(server, smollm2_tokenizer):
    client = _client(server)
    r = client.chat.completions.create(messages=ASK, tools=TOOLS, max_tokens=12, model="smollm2", temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls  # SmolLM2 chats
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
                                       logit_bias=_trigger_bias(smollm2_tokenizer), **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    _check_call(r.choices[0].message.tool_calls[0])


@pytest.mark.timeout(240)
def test_streamed_deltas_reassemble_into_the_same_call(server, smollm2_tokenizer):
    client = _client(server)
    kwargs = dict(messages=ASK, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
                  logit_bias=_trigger_bias(smollm2_tokenizer), **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, reason, first = _stream(client, **kwargs)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    assert first.type == "function" and first.function.name == "get_weather" and first.function.arguments == ""
    call_id, name, args = calls[0]
    assert call_id.startswith("call_") and name == whole.message.tool_calls[0].function.name
    assert args == whole.message.tool_calls[0].function.arguments  # same text, streamed in pieces
    jsonschema.validate(json.loads(args), PARAMS)


@pytest.mark.timeout(240)
def test_history_with_tool_calls_and_results(server):
    client = _client(server)
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", **GREEDY)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    without = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", **GREEDY)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the call and result are in the prompt
    # the next turn may call again, constrained as before
    r = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names function 'nope', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs a non-empty tools list'),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with another constraint (json_schema"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"regex": "a+"}}, "tool_choice", "(regex"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not valid JSON"),
])
def test_bad_values_are_400s_naming_the_field(server, extra, param, message):
    kwargs = {"messages": ASK, **GREEDY, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(**kwargs)
    assert e.value.status_code == 400 and message in e.value.body["message"], e.value.body
    assert e.value.body["param"] == param


@pytest.mark.timeout(240)
def test_required_call_on_llguidance(server_llguidance):
    """The same grammar through llguidance (its Lark translation of the structural tag)."""
    r = _client(server_llguidance).chat.completions.create(
        messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0])
