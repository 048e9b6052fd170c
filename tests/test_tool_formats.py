"""Every tool-call format (--tool-call-parser; srt/function_call/formats.py) under the same
guarantee, without a server: render -> parse round trips (whole and split at every
character), the grammar accepting exactly the calls python-jsonschema judges valid (real
xgrammar and, for JSON arguments, llguidance; SmolLM2's tokenizer with the literal strings),
named / required / parallel_tool_calls, strict 400s, the frontend's document check finding
each style's calls, stream vs non-stream, and our per-call tags against xgrammar's built-in
structural tags. Real family tokenizers and chat templates: test_tool_format_templates.py."""
from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from constrained.base_grammar_backend import InvalidGrammarObject
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.tag_parts import NAME_KEY, tag_parts
from constrained.tag_plan import plan_tag
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampling_params import SamplingParams
from srt.entrypoints.openai_protocol import ChatCompletionRequest
from srt.frontend.document_check import DocumentChecker
from srt.function_call.formats import TOOL_CALL_PARSERS, get_format
from srt.function_call.grammar import tool_call_structural_tag
from srt.function_call.parser import ToolCallParser
from srt.function_call.prompt import prepare_messages, render_calls
from srt.function_call.serving import ToolCalling
from srt.function_call.tools import ToolCallError, resolve
from srt.server_args import ServerArgs
from test_grammar_backend import accepts

VOCAB, EOS = 49152, (2,)
FORMATS = sorted(set(f.name for f in TOOL_CALL_PARSERS.values()))
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["c", "f"]}}}
NOTE_PARAMS = {"type": "object", "additionalProperties": False, "required": ["text"], "properties": {
    "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
NOTE = {"type": "function", "function": {"name": "add_note", "parameters": NOTE_PARAMS}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, NOTE, PING]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add_note": NOTE_PARAMS, "ping": {"type": "object", "properties": {}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3, "unit": "c"}),
         ("add_note", {"text": 'line 1\nline "2" and \\ back', "tags": ["a", "b c"]}), ("ping", {})]
# The judge's candidates for get_weather: valid and not, each by python-jsonschema.
CANDIDATES = [{"city": "Rome", "days": 14}, {"city": "New York", "days": 1, "unit": "f"},
              {"city": "Rome"}, {"city": "Rome", "days": 0}, {"city": "Rome", "days": 15},
              {"city": "Rome", "days": 2.5}, {"city": "Rome", "days": 2, "unit": "k"},
              {"city": "Rome", "days": 2, "wind": True}, {"city": "x" * 21, "days": 2}, {"days": 2}]


def fmt_of(name):
    return get_format(name)


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer):
    cfg = GrammarBackendConfig(VOCAB, EOS, JsonOptions())
    return {"xgrammar": XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, cfg),
            "llguidance": GuidanceBackend.from_tokenizer(smollm2_tokenizer, cfg)}


def grammar(backend, fmt, choice, parallel=None, tools=TOOLS):
    tag = tool_call_structural_tag(resolve(tools, choice, parallel), fmt, max_whitespace=16)
    spec = SamplingParams.from_dict({"structural_tag": tag}).structural_tag  # as a request carries it
    value = backend.init_value(("structural_tag", spec))
    assert not isinstance(value, InvalidGrammarObject), value.message
    return value


def complete(g, tok, text, masks: bool = False) -> bool:
    """``text`` is accepted and the grammar may end there (EOS allowed). ``masks``: check
    each token against the filled vocab mask too (0.5 s a call at this vocab size)."""
    g = g.copy()
    try:
        if masks:
            return accepts(g, tok, text) and accepts(g, tok, tok.eos_token)
        for t in tok.encode(text) + [tok.eos_token_id]:
            g.accept_token(t)
        return True
    except ValueError:  # the grammar refused a token
        return False


def parse(fmt, text, step=None):
    p = ToolCallParser(fmt, SCHEMAS)
    for i in range(0, len(text), step or max(1, len(text))):
        p.feed(text[i:i + (step or len(text))])
    p.finish()
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.complete_calls]


def backend_names(fmt):
    return ["xgrammar", "llguidance"] if fmt.args_style == "json" else ["xgrammar"]


# ---- render / parse ------------------------------------------------------------------------
@pytest.mark.parametrize("name", FORMATS)
def test_render_parse_round_trip_whole_and_at_every_split(name):
    fmt = fmt_of(name)
    text = render_calls(fmt, CALLS)
    assert parse(fmt, text) == ("", CALLS), text
    assert parse(fmt, text, step=1) == ("", CALLS)
    content, calls = parse(fmt, "Let me check. " + text)
    assert content == "Let me check." and calls == CALLS
    for cut in range(len(text)):  # cut anywhere: never a call that was not whole
        content, calls = parse(fmt, text[:cut])
        assert all(c in CALLS for c in calls)


@pytest.mark.parametrize("name", FORMATS)
def test_text_that_only_looks_like_a_call_stays_content(name):
    fmt = fmt_of(name)
    for text in ["I like [brackets] and {\"name\": 1}.", fmt.trigger + "not a call!"]:
        content, calls = parse(fmt, text)
        assert calls == [] and content == text


# ---- grammar -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FORMATS)
def test_required_named_and_parallel_grammars(name, backends, smollm2_tokenizer):
    fmt, tok = fmt_of(name), smollm2_tokenizer
    for backend in backend_names(fmt):
        b = backends[backend]
        req = grammar(b, fmt, "required")
        assert complete(req, tok, render_calls(fmt, CALLS), masks=True), (backend, render_calls(fmt, CALLS))
        assert complete(req, tok, render_calls(fmt, CALLS[:1]))
        assert not complete(req, tok, "Hello " + render_calls(fmt, CALLS[:1]))  # calls and nothing else
        assert not complete(req, tok, render_calls(fmt, [("get_time", {})]))  # not a listed tool
        one = grammar(b, fmt, "required", parallel=False)
        assert complete(one, tok, render_calls(fmt, CALLS[1:2]))
        assert not complete(one, tok, render_calls(fmt, CALLS[:2]))
        named = grammar(b, fmt, {"type": "function", "function": {"name": "add_note"}})
        assert complete(named, tok, render_calls(fmt, CALLS[1:2]))
        assert not complete(named, tok, render_calls(fmt, CALLS[:1]))
        auto = grammar(b, fmt, "auto")
        assert complete(auto, tok, "Sure: " + render_calls(fmt, CALLS[:1]))
        assert complete(auto, tok, "No call needed.")


@pytest.mark.parametrize("name", FORMATS)
def test_grammar_accepts_exactly_the_calls_jsonschema_judges_valid(name, backends, smollm2_tokenizer):
    """Where the plan says the grammar is exact (JSON arguments; XML ones but for a raw
    string's length) it accepts exactly the valid calls; where it approximates (pythonic,
    XML maxLength) it accepts every valid call and the frontend's check catches the rest."""
    fmt, tok = fmt_of(name), smollm2_tokenizer
    checker = DocumentChecker(ServerArgs(model_path="x"), None)
    for backend in backend_names(fmt):
        g = grammar(backends[backend], fmt, {"type": "function", "function": {"name": "get_weather"}})
        tag = json.dumps(tool_call_structural_tag(
            resolve(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None), fmt))
        exact = plan_tag(tag_parts(json.loads(tag)), backend, JsonOptions()).exact
        assert exact == (fmt.args_style == "json"), (backend, name)  # maxLength: raw XML strings
        for args in CANDIDATES:
            text = render_calls(fmt, [("get_weather", args)])
            parsed = parse(fmt, text)[1]
            valid = jsonschema.Draft202012Validator(WEATHER_PARAMS).is_valid(parsed[0][1]) if parsed else False
            accepted = complete(g, tok, text)
            violation, checked = checker._tag_documents(tag, text)
            if valid:
                assert accepted and violation is None and checked, (backend, text)
            elif not exact:
                assert violation is not None or not parsed, text  # never reported as a valid call
            else:
                assert not accepted, (backend, text)


def _strict_body(params):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params, "strict": True}}
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [tool], "tool_choice": "required"})


def test_strict_is_exact_or_a_400_naming_tool_keyword_and_format():
    body = _strict_body(WEATHER_PARAMS)
    with pytest.raises(ToolCallError, match=r"tools\[0\] \(get_weather\): function.strict.*pythonic"):
        ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser="pythonic"))
    with pytest.raises(ToolCallError, match=r"tools\[0\] \(get_weather\): function.strict.*maxLength at "
                                            r"#/properties/city \(qwen_xml raw string\)"):
        ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser="qwen3_coder"))
    no_length = {**WEATHER_PARAMS, "properties": {**WEATHER_PARAMS["properties"], "city": {"type": "string"}}}
    for name in FORMATS:
        if name != "pythonic":
            calling = ToolCalling.prepare(_strict_body(no_length), [], None,
                                          ServerArgs(model_path="x", tool_call_parser=name))[0]
            assert calling.constraint is not None, name
            assert not calling.held or get_format(name).args_style != "json"  # JSON exact: streams as written
    with pytest.raises(ToolCallError, match="qwen3_coder tool-call format.*xgrammar"):
        ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser="qwen3_coder",
                                                        grammar_backend="llguidance"))


# ---- stream vs whole; history ----------------------------------------------------------------
@pytest.mark.parametrize("name", FORMATS)
def test_stream_gives_the_same_calls_as_the_whole_text(name):
    fmt = fmt_of(name)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, "tool_choice": "auto"})
    calling = ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser=name))[0]
    text = "Checking. " + render_calls(fmt, CALLS)
    whole, reason = calling.message(text, "stop")
    assert reason == "tool_calls" and whole["content"] == "Checking."
    stream = calling.stream(lambda schema, args: jsonschema.Draft202012Validator(
        json.loads(schema)).is_valid(json.loads(args)))
    deltas = [d for ch in text for d in stream.deltas(ch)] + stream.finish("stop")[0]
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["type"] == "function" and set(c["function"]) == {"name", "arguments"}
                calls[c["index"]] = [c["id"], c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][2] += c["function"]["arguments"]
    assert content.strip() == "Checking."
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == CALLS
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == CALLS
    if fmt.call_id_style == "mistral9":
        assert all(len(i) == 9 and i.isalnum() for i, _, _ in calls.values())


@pytest.mark.parametrize("name", FORMATS)
def test_history_is_rendered_back_in_the_format(name):
    """A template without tools gets the history's calls as the format's text, which the
    parser reads back as the same calls (multi-turn tool use)."""
    fmt = fmt_of(name)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(CALLS)]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    msgs, kwargs = prepare_messages(history, resolve(TOOLS, "auto", None), fmt, native=False)
    assistant = next(m for m in msgs if m["role"] == "assistant")
    assert parse(fmt, assistant["content"]) == ("", CALLS)
    assert "sunny" in msgs[-1]["content"] and kwargs == {}
    native, _ = prepare_messages(history, resolve(TOOLS, "auto", None), fmt, native=True)
    ids = [c["id"] for c in native[1]["tool_calls"]] + [native[2]["tool_call_id"]]
    if fmt.call_id_style == "mistral9":  # Mistral's templates raise on other ids
        assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] == ids[-1]


# ---- xgrammar's built-in structural tags ----------------------------------------------------
def _call_tags(fmt_tree) -> list[tuple[str, str]]:
    found = []

    def walk(node):
        if isinstance(node, list):
            for n in node:
                walk(n)
        elif isinstance(node, dict):
            content = node.get("content")
            if node.get("type") == "tag" and isinstance(content, dict) and content.get("type") == "json_schema":
                found.append((node["begin"], node["end"], content.get("style", "json")))
            for v in node.values():
                walk(v)
    walk(fmt_tree)
    return sorted(found)


def _normal(node):
    """A tag tree without the defaults xgrammar's dump spells out."""
    if isinstance(node, list):
        return [_normal(n) for n in node]
    if not isinstance(node, dict):
        return node
    defaults = {"excludes": [], "any_order": False, "style": "json", "at_least_one": False, "stop_after_first": False}
    return {k: _normal(v) for k, v in node.items() if not (k in defaults and v == defaults[k])}


@pytest.mark.parametrize("name", [n for n in FORMATS if fmt_of(n).builtin])
def test_auto_and_named_tags_are_xgrammars_builtin_ones(name):
    """``auto`` and named: the whole tag is the built-in's; ``required``: the same per-call tags."""
    fmt = fmt_of(name)
    named = {"type": "function", "function": {"name": "add_note"}}
    for choice, parallel in [("auto", True), ("auto", False), (named, True), ("required", True)]:
        ours = tool_call_structural_tag(resolve(TOOLS, choice, parallel), fmt)
        req = resolve(TOOLS, choice, parallel)
        theirs = xgr.get_model_structural_tag(
            fmt.builtin, tools=[{"type": "function", "function": {"name": t.name, "parameters": {
                **t.parameters, NAME_KEY: t.name}}} for t in req.tools], tool_choice=choice, reasoning="disabled",
            exclude_special_tokens=False, parallel_tool_calls=parallel).model_dump(exclude_none=True)
        if choice == "required":
            assert _call_tags(ours) == _call_tags(theirs), name
        else:
            assert _normal(ours) == _normal(theirs), (name, choice, parallel)


def test_unenforceable_tool_choice_is_a_400_naming_the_format_never_a_silent_auto():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": TOOLS, "tool_choice": "auto"})
    for name in FORMATS:
        with pytest.raises(ToolCallError, match=f"tool_choice 'auto' cannot be enforced in the {name} "
                                                "tool-call format: this server runs --grammar-backend none"):
            ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser=name,
                                                            grammar_backend="none"))


def test_format_chosen_from_the_chat_template_and_logged(caplog):
    from srt.function_call.format_choice import choose_format
    from tool_format_data import load_template

    choose_format.cache_clear()
    with caplog.at_level("INFO", logger="srt.function_call.format_choice"):
        fmt, why = choose_format(None, load_template("qwen3_5"))
    assert fmt.name == "qwen3_coder" and "<function=" in why
    assert "tool-call format qwen3_coder, chosen by the chat template" in caplog.text
    assert choose_format(None, "{{ messages }}")[0].name == "hermes"  # no marker: the default
    assert choose_format("mistral", load_template("qwen3_5"))[1] == "--tool-call-parser mistral"


def test_pythonic_refuses_tools_python_cannot_spell():
    for tool, why in [({"name": "get-weather"}, "tool name 'get-weather'"),
                      ({"name": "f", "parameters": {"type": "object", "properties": {"from": {"type": "string"}}}},
                       "from")]:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [PING, {"type": "function", "function": tool}]})
        with pytest.raises(ToolCallError, match=rf"tools\[1\] \({tool['name']}\): the pythonic .*{why}"):
            ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser="pythonic"))
        ToolCalling.prepare(body, [], None, ServerArgs(model_path="x", tool_call_parser="hermes"))  # fine there
