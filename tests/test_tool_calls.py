"""Tool calling without a server (srt/function_call): validation of tools / tool_choice,
the grammar compiled by the real xgrammar and llguidance backends (valid calls accepted,
invalid ones rejected), the parsers (final, and streaming split at every character), the
history / system-prompt rendering and the response shapes."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from constrained.base_grammar_backend import InvalidGrammarObject
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.structural_tag_lark import structural_tag_to_lark
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampling_params import SamplingParams
from srt.entrypoints.openai_protocol import ChatCompletionRequest, validation_error_message
from srt.function_call.formats import HERMES, get_format
from srt.function_call.grammar import tool_call_structural_tag
from srt.function_call.parser import ToolCallParser
from srt.function_call.prompt import prepare_messages, template_supports_tools
from srt.function_call.serving import ToolCalling
from srt.function_call.tools import resolve
from test_grammar_backend import accepts, rejects

VOCAB, EOS = 49152, (2,)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NOARGS]
USER = [{"role": "user", "content": "hi"}]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


PARIS = call("get_weather", '{"city": "Paris", "unit": "c"}')
UTC = call("get_time", '{"tz": "UTC"}')


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, smollm2_tokenizer):
    cls = XGrammarGrammarBackend if request.param == "xgrammar" else GuidanceBackend
    return cls.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, EOS, JsonOptions()))


def grammar(backend, choice, parallel=None, tools=TOOLS):
    tag = tool_call_structural_tag(resolve(tools, choice, parallel), HERMES, max_whitespace=16)
    spec = SamplingParams.from_dict({"structural_tag": tag}).structural_tag  # as a request carries it
    value = backend.init_value(("structural_tag", spec))
    assert not isinstance(value, InvalidGrammarObject), value.message
    return value


def complete(backend, tok, choice, text, parallel=None) -> bool:
    """``text`` is accepted and the grammar may end there (EOS allowed)."""
    g = grammar(backend, choice, parallel).copy()
    return accepts(g, tok, text) and accepts(g, tok, tok.eos_token)


# ---- grammar ---------------------------------------------------------------------------
def test_required_grammar_forces_valid_calls(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert complete(backend, tok, "required", PARIS)
    assert complete(backend, tok, "required", PARIS + "\n" + UTC)  # parallel by default
    assert complete(backend, tok, "required", call("ping", "{}"))
    assert not complete(backend, tok, "required", PARIS + "\n" + UTC, parallel=False)
    g = grammar(backend, "required")
    for bad in ["Sure! " + PARIS,  # no text: calls only
                call("get_weather", '{"city": "Paris", "unit": "kelvin"}'),  # enum
                call("get_weather", '{"city": "Paris"}'),  # required key missing
                call("get_weather", '{"city": "Paris", "unit": "c", "x": 1}'),  # extra key
                call("send_mail", "{}")]:  # unknown function
        assert rejects(g.copy(), tok, bad), bad
    assert rejects(g.copy(), tok, tok.eos_token)  # at least one call


def test_named_grammar_is_one_call_of_that_function(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    named = {"type": "function", "function": {"name": "get_time"}}
    assert complete(backend, tok, named, UTC)
    g = grammar(backend, named)
    assert rejects(g.copy(), tok, PARIS)
    assert rejects(g.copy(), tok, UTC + "\n" + UTC)


def test_auto_grammar_allows_text_then_constrains_after_the_trigger(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert complete(backend, tok, "auto", "It is sunny today.")
    assert complete(backend, tok, "auto", "Let me look. " + PARIS + " Done.")
    assert complete(backend, tok, "auto", PARIS + "\n" + UTC)
    assert complete(backend, tok, "auto", "x " + PARIS, parallel=False)
    assert not complete(backend, tok, "auto", PARIS + "\n" + UTC, parallel=False)  # ends after one
    g = grammar(backend, "auto")
    assert rejects(g.copy(), tok, "Let me look. " + call("get_weather", '{"town": "Paris"}'))
    assert rejects(g.copy(), tok, "<tool_call>\nhello")  # after the trigger: a call only


def test_lark_translation_rejects_what_it_cannot_express():
    with pytest.raises(ValueError, match="format type 'qwen_xml_parameter'"):
        structural_tag_to_lark({"format": {"type": "qwen_xml_parameter"}}, lambda s, w: s)
    with pytest.raises(ValueError, match="excludes"):
        structural_tag_to_lark({"format": {"type": "any_text", "excludes": ["x"]}}, lambda s, w: s)


# ---- parsers ---------------------------------------------------------------------------
def run_stream(chunks: list[str]):
    """Feed ``chunks``; reassemble content and calls from the deltas, as a client would."""
    p, content, calls = ToolCallParser(HERMES), "", {}
    for piece in [*chunks, None]:
        d = p.feed(piece) if piece is not None else p.finish()
        content += d.content
        for index, call_id, name, args in d.calls:
            if call_id is not None:
                assert index == len(calls) and args == ""  # a call opens with name, empty args
                calls[index] = [name, ""]
            calls[index][1] += args
    return content, [tuple(c) for c in calls.values()], p


TEXT = "Let me check.  " + PARIS + "\n" + call("get_time", '{"tz": "Europe/\\"Paris\\" {x}"}') + "\nDone. <tool"


def test_final_parse_separates_content_and_calls():
    content, calls, p = run_stream([TEXT])
    assert content == "Let me check.\nDone. <tool"  # whitespace around calls dropped; "<tool" not a trigger
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}'),
                     ("get_time", '{"tz": "Europe/\\"Paris\\" {x}"}')]
    assert [c.complete for c in p.calls] == [True, True] and all(c.id.startswith("call_") for c in p.calls)
    for args in (a for _, a in calls):
        json.loads(args)


def test_stream_split_at_every_character_boundary_gives_the_same_result():
    want = run_stream([TEXT])[:2]
    for i in range(len(TEXT) + 1):
        assert run_stream([TEXT[:i], TEXT[i:]])[:2] == want, i
    for i in range(0, len(TEXT), 7):  # three pieces
        assert run_stream([TEXT[:i], TEXT[i:i + 5], TEXT[i + 5:]])[:2] == want, i
    assert run_stream(list(TEXT))[:2] == want


def test_text_that_only_looks_like_a_call_stays_content():
    assert run_stream(["a <tool_call>\nnot json"])[:2] == ("a <tool_call>\nnot json", [])
    assert run_stream(["a <tool_", "call"])[:2] == ("a <tool_call", [])  # held back, then released
    content, calls, p = run_stream(['x <tool_call>\n{"name": "f", "arguments": {"a": [1, ']) # cut
    assert content == "x" and calls == [("f", '{"a": [1, ')] and not p.calls[0].complete


def test_response_message_and_finish_reason():
    tools = ToolCalling(resolve(TOOLS, "auto", None), HERMES, None)
    message, reason = tools.message("Sure. " + PARIS, "stop")
    assert reason == "tool_calls" and message["content"] == "Sure."
    assert [(c["type"], c["function"]["name"]) for c in message["tool_calls"]] == [("function", "get_weather")]
    message, reason = tools.message(PARIS, "stop")
    assert message["content"] is None and reason == "tool_calls"
    cut = PARIS[:-5]  # max_tokens inside the call: no call, the text is content
    assert tools.message(cut, "length") == ({"content": cut}, "length")
    assert tools.message("plain answer ", "stop") == ({"content": "plain answer "}, "stop")
    none = ToolCalling(resolve(TOOLS, "none", None), HERMES, None)
    assert none.message(PARIS, "stop") == ({"content": PARIS}, "stop")  # none: not parsed


def test_stream_deltas_have_openai_shape():
    stream = ToolCalling(resolve(TOOLS, "required", None), HERMES, None).stream()
    deltas = [d for piece in (PARIS[:30], PARIS[30:]) for d in stream.deltas(piece)]
    last, reason = stream.finish("stop")
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:])
    assert args == '{"city": "Paris", "unit": "c"}' and not last and reason == "tool_calls"
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])


# ---- prompt / history ------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
]


def test_template_without_tools_gets_the_default_format_as_text():
    msgs, kwargs = prepare_messages(HISTORY, resolve(TOOLS, "auto", None), HERMES, native=False)
    assert kwargs == {}
    assert msgs[0]["role"] == "system" and HERMES.render_tools(TOOLS) == msgs[0]["content"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": PARIS + "\n" + call("get_time", '{"tz": "CET"}')}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                                                   "<tool_response>\n14:00\n</tool_response>"}
    # tool_choice none: the tools are not shown; a system message gets the section appended
    msgs, _ = prepare_messages([{"role": "system", "content": "Be brief."}, *USER],
                               resolve(TOOLS, "required", None), HERMES, native=False)
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and len(msgs) == 2
    assert prepare_messages(USER, resolve(TOOLS, "none", None), HERMES, native=False)[0] == USER


def test_template_with_tools_gets_them_natively(smollm2_tokenizer):
    assert not template_supports_tools(smollm2_tokenizer)
    msgs, kwargs = prepare_messages(HISTORY, resolve(TOOLS, "auto", None), HERMES, native=True)
    assert kwargs == {"tools": TOOLS} and msgs[2] == HISTORY[2]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}  # parsed


@pytest.mark.parametrize("history, where", [
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], r"messages\[0\].tool_calls\[0\]"),
    ([{"role": "user", "tool_calls": []}], r"messages\[0\].tool_calls must be a list, on an assistant"),
])
def test_bad_history_names_the_message(history, where):
    with pytest.raises(ValueError, match=where) as e:
        prepare_messages(history, resolve(None, None, None), HERMES, native=False)
    assert e.value.param == "messages"


# ---- request validation ----------------------------------------------------------------
@pytest.mark.parametrize("extra, msg", [
    ({"tools": [{"type": "function"}]}, "tools: tools[0].function must be an object"),
    ({"tools": [{"type": "retrieval"}]}, 'tools: tools[0].type must be "function"'),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name 'get_weather' is not unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "parameters must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "unknown field(s): function.x"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: tool_choice names function 'nope', which is not in tools (known: get_weather, get_time, ping)"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs a non-empty tools list'),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "not in tools (known: none)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"name": "f"}}, "named tool_choice must be"),
])
def test_bad_tools_and_tool_choice_name_the_field(extra, msg):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": USER, **extra})
    text, param = validation_error_message(e.value)
    assert msg in text and param == text.split(":")[0]


def test_tools_with_another_constraint_is_an_error_naming_both():
    body = ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "regex": "a+"})
    tools, _, _ = ToolCalling.prepare(body, USER, None, None)
    with pytest.raises(ValueError, match="tool_choice 'auto' .* another constraint \\(regex") as e:
        tools.constrain(body.sampling_params())
    assert e.value.param == "tool_choice"
    none = ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": "none",
                                                 "regex": "a+"})
    ToolCalling.prepare(none, USER, None, None)[0].constrain(none.sampling_params())  # fine


def test_parser_names_and_defaults():
    assert get_format(None) is HERMES and get_format("qwen25") is HERMES and get_format("hermes") is HERMES
    with pytest.raises(ValueError, match="Unknown tool call parser"):
        get_format("llama4_json")
    assert resolve(TOOLS, None, None).mode == "auto" and resolve(None, None, None).mode == "none"
    req = resolve(TOOLS, {"type": "function", "function": {"name": "ping"}}, False)
    assert req.mode == "named" and [t.name for t in req.tools] == ["ping"] and not req.parallel
    assert req.tools[0].parameters == {"type": "object", "properties": {}}  # no parameters: none


# ---- in the real scheduler ---------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_scheduler_generates_a_whole_call_with_fast_forward(backend_name, smollm2_dir, smollm2_tokenizer):
    """The call's closing literal is forced (fast-forward) and must reach the output whole:
    llguidance takes all forced tokens at once and is already terminated after them."""
    from srt.transport.io_struct import TokenizedGenerateReq
    from test_scheduler import make_scheduler, run_until_done

    tok = smollm2_tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    calling, msgs, kwargs = ToolCalling.prepare(
        ChatCompletionRequest.model_validate({"messages": USER, "tools": tools, "tool_choice": "required",
                                              "parallel_tool_calls": False}), USER, tok, None)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    sp = {"temperature": 0, "max_new_tokens": 40}
    calling.constrain(sp)
    s = make_scheduler(smollm2_dir, tok, max_total_tokens=4096, grammar_backend=backend_name,
                       disable_torch_compile=True)
    out = run_until_done(s, {0: [TokenizedGenerateReq("t", tuple(ids), SamplingParams.from_dict(sp))]})["t"]
    s.grammar_manager.backend.shutdown()
    text = tok.decode(out["ids"], skip_special_tokens=True)
    assert out["finish"].type == "stop" and text.endswith("}\n</tool_call>"), text
    message, reason = calling.message(text, "stop")
    args = json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert reason == "tool_calls" and args["city"] in ("Paris", "Rome")


def test_lark_translation_of_the_other_format_types(backend, smollm2_tokenizer):
    """Both backends read these ``format`` types alike (llguidance via the Lark translation)."""
    lit = lambda v: {"type": "const_string", "value": v}  # noqa: E731
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        lit("a"), {"type": "or", "elements": [lit("b"), lit("c")]}, {"type": "optional", "content": lit("d")},
        {"type": "star", "content": lit("e")}, {"type": "json_schema", "json_schema": {"type": "integer"}}]}}
    value = backend.init_value(("structural_tag", json.dumps(tag)))
    assert not isinstance(value, InvalidGrammarObject), value.message
    tok = smollm2_tokenizer
    for good in ("ab7", "acdee12"):
        assert accepts(value.copy(), tok, good) and accepts(value.copy(), tok, good + tok.eos_token), good
    for bad in ("ad1", "abx", "abdd1"):
        assert rejects(value.copy(), tok, bad), bad
