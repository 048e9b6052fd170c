"""The structured-output guarantee for structural tags and tool calls, and ``strict`` decided
statically (no server): constrained/tag_parts.py, tag_plan.py, strict_check.py against the
real grammar libraries built on SmolLM2's tokenizer.

* The frontend's static strict decision equals what each backend decides when it compiles,
  on the real-world schema corpus and the keyword cases (so a 400 before the first byte is
  never a schema a rank would have served, nor the reverse).
* Tag parts are found, planned and compiled as the ranks compile them; numbers are bounded
  in tool arguments under xgrammar too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from xgrammar.testing import _is_grammar_accept_string

from constrained.auto_backend import AutoGrammarBackend
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.schema_coverage import StrictSchemaError, with_strict
from constrained.strict_check import check_strict
from constrained.tag_parts import NAME_KEY, find_documents, map_parts, tag_parts
from constrained.tag_plan import StrictPartError, plan_tag
from srt.function_call.formats import HERMES
from srt.function_call.grammar import tool_call_structural_tag
from srt.function_call.tools import resolve

VOCAB, EOS = 49152, (2,)
OPTS = JsonOptions()
ROOT = Path(__file__).resolve().parents[1]
# One schema per keyword the issue names; none is exact in both libraries.
KEYWORD_SCHEMAS = {
    "not": {"type": "object", "properties": {"word": {"type": "string", "not": {"pattern": "^[a-z]"}}},
            "required": ["word"]},
    "uniqueItems": {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"},
                                                           "uniqueItems": True}}, "required": ["t"]},
    "allOf": {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                          {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "multipleOf": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}, "required": ["n"]},
    "if": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"}},
           "required": ["kind", "x"], "if": {"properties": {"kind": {"const": "a"}}},
           "then": {"properties": {"x": {"minimum": 100}}}},
    "oneOf": {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}},
              "required": ["v"]},
    "format": {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
}


def _corpus() -> list[tuple[str, dict]]:
    out = [(f"keyword:{k}", s) for k, s in KEYWORD_SCHEMAS.items()]
    for file in ("real_schema_corpus.json", "schema_corpus.json"):
        for entry in json.loads((ROOT / "benchmark" / "data" / file).read_text())["schemas"]:
            out.append((f"{file}:{entry['name']}", entry["schema"]))
    return out


CORPUS = _corpus()


@pytest.fixture(scope="module")
def auto(smollm2_tokenizer):
    backend = AutoGrammarBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, EOS, JsonOptions()))
    yield backend
    backend.shutdown()


def _rank_refuses_strict(backend, spec: str) -> bool:
    try:
        backend.compile_json_schema(spec, True)
    except StrictSchemaError:
        return True
    except Exception:  # any other compile failure: not a strict decision
        return None
    return False


def _frontend_refuses_strict(name: str, spec: str) -> bool:
    try:
        check_strict(json.dumps(with_strict(json.loads(spec), True)), None, name, OPTS)
    except StrictSchemaError:
        return True
    except ValueError:
        return None
    return False


@pytest.mark.timeout(600)
def test_frontend_strict_decision_equals_the_ranks(auto):
    """For every corpus schema and each backend, the static check refuses strict exactly
    when compiling with strict would (the compile errors of both are the same schemas)."""
    # (xgrammar alone decides from xgrammar_gaps before it compiles, in both places: the same call)
    backends = {"auto": auto, "llguidance": auto.guidance}
    compared = refused = 0
    for label, schema in CORPUS:
        spec = json.dumps(schema)
        for name, backend in backends.items():
            rank = _rank_refuses_strict(backend, spec)
            if rank is None:
                continue  # the library cannot compile it at all (a 400 either way)
            assert _frontend_refuses_strict(name, spec) == rank, (label, name)
            compared += 1
            refused += rank
    assert compared > 200 and 0 < refused < compared


def _tools_tag(strict_word: bool, names=("get_word", "tags")) -> dict:
    tools = [{"type": "function", "function": {"name": names[0], "strict": strict_word,
                                               "parameters": KEYWORD_SCHEMAS["not"]}},
             {"type": "function", "function": {"name": names[1], "parameters": KEYWORD_SCHEMAS["uniqueItems"]}}]
    return tool_call_structural_tag(resolve(tools, "required", None), HERMES, 16)


def test_tool_parts_carry_name_and_strict_and_the_library_copy_drops_them():
    parts = tag_parts(_tools_tag(True))
    assert [(p.name, p.strict, p.max_whitespace) for p in parts] == [("get_word", True, 16), ("tags", False, 16)]
    assert parts[0].begin == '<tool_call>\n{"name": "get_word", "arguments": '
    assert parts[0].schema == KEYWORD_SCHEMAS["not"]  # our keywords stripped
    lib = json.dumps(map_parts(_tools_tag(True), lambda p: p.schema))
    assert NAME_KEY not in lib and "x-gramsync-strict" not in lib


def test_strict_tool_refused_by_every_backend_naming_tool_keyword_and_path():
    parts = tag_parts(_tools_tag(True))
    for backend in ("xgrammar", "llguidance", "auto"):
        with pytest.raises(StrictPartError) as e:
            plan_tag(parts, backend, OPTS)
        assert e.value.part.name == "get_word"
        assert "get_word" in str(e.value) and "not at #/properties/word" in str(e.value)


def test_auto_plan_takes_the_library_dropping_fewer_keywords():
    parts = tag_parts(_tools_tag(False))
    plan = plan_tag(parts, "auto", OPTS)
    assert plan.library == "llguidance" and plan.lenient == (True, True)
    assert plan.gaps == ("not at #/properties/word in get_word", "uniqueItems at #/properties/t in tags")
    exact = tag_parts(tool_call_structural_tag(resolve([{"type": "function", "function": {
        "name": "f", "parameters": KEYWORD_SCHEMAS["multipleOf"]}}], "required", None), HERMES, 16))
    assert plan_tag(exact, "auto", OPTS).exact  # llguidance enforces multipleOf
    outside = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A:"}, {"type": "json_schema", "json_schema": KEYWORD_SCHEMAS["not"]}]}}
    with pytest.raises(StrictPartError, match="outside a tag"):  # must be exact; nothing enforces `not`
        check_strict(None, json.dumps(outside), "auto", OPTS)


def test_find_documents_only_completed_parts():
    parts = tag_parts(_tools_tag(False))
    one = '<tool_call>\n{"name": "get_word", "arguments": {"word": "ok"}}\n</tool_call>'
    two = '<tool_call>\n{"name": "tags", "arguments": {"t": ["a", "a"]}}\n</tool_call>'
    cut = '<tool_call>\n{"name": "tags", "arguments": {"t": ["a", '
    found = [(p.name, d) for p, d in find_documents(f"hi {one}\n{two}\n{cut}", parts)]
    assert found == [("get_word", '{"word": "ok"}'), ("tags", '{"t": ["a", "a"]}')]
    assert list(find_documents('<tool_call>\n{"name": "tags", "arguments": {"t": []}  no end', parts)) == []
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "object", NAME_KEY: "f"}, "end": "</f>"}],
              "triggers": ["<f>"]}
    assert [(p.name, d) for p, d in find_documents("x <f> {} </f>", tag_parts(legacy))] == [("f", "{}")]


@pytest.mark.parametrize("library", ["xgrammar", "llguidance"])
def test_tool_arguments_compile_with_gaps_reported_and_numbers_bounded(auto, library):
    """Each library compiles the tools' tag (an approximation: gaps named per tool) and bounds
    integers to int64 in arguments (README: number bounds under every backend)."""
    backend = auto.xgrammar if library == "xgrammar" else auto.guidance
    tools = [{"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
        "required": ["n", "x"]}}}, {"type": "function", "function": {"name": "get_word",
                                                                     "parameters": KEYWORD_SCHEMAS["not"]}}]
    tag = tool_call_structural_tag(resolve(tools, "required", None), HERMES, 16)
    value = backend.dispatch_structural_tag(json.dumps(tag))
    assert any("in get_word" in g for g in value.stats.gaps)
    if library == "xgrammar":
        compiled = value.compiled.grammar
        head = '<tool_call>\n{"name": "count", "arguments": {"n": '
        assert _is_grammar_accept_string(compiled, head + '9223372036854775807, "x": 1.5}}\n</tool_call>')
        assert not _is_grammar_accept_string(compiled, head + '92233720368547758070, "x": 1.5}}\n</tool_call>')
        assert not _is_grammar_accept_string(compiled, head + '1, "x": 1' + "0" * 20 + '}}\n</tool_call>')


def test_stream_holds_calls_of_inexact_tools_until_complete_and_valid():
    """An approximate tool's call is streamed whole once complete, and only if it validates;
    an exact tool's arguments stream as generated (srt/function_call/serving.py)."""
    from constrained.schema_validation import SchemaValidators
    from srt.function_call.serving import ToolCalling

    tools = [{"type": "function", "function": {"name": "get_word", "parameters": KEYWORD_SCHEMAS["not"]}},
             {"type": "function", "function": {"name": "plain", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    req = resolve(tools, "required", None)
    args = type("Args", (), {"grammar_backend": "auto", "constrained_json_disable_any_whitespace": False,
                             "constrained_json_whitespace_pattern": None, "constrained_json_max_whitespace": 16,
                             "constrained_json_unbounded_numbers": False})()
    calling = ToolCalling.prepare(type("Body", (), {"tools": tools, "tool_choice": "required",
                                                    "parallel_tool_calls": None})(), [], None, args)[0]
    assert calling.held == {"get_word"} and calling.req == req
    validators = SchemaValidators()
    stream = calling.stream(lambda schema, doc: validators.validate(schema, doc) is None)
    plain = '<tool_call>\n{"name": "plain", "arguments": {"a": 1'
    first = stream.deltas(plain)
    assert first and first[0]["tool_calls"][0]["function"]["name"] == "plain"  # streams at once
    bad = '}}\n</tool_call>\n<tool_call>\n{"name": "get_word", "arguments": {"word": "lower"'
    assert all("get_word" not in json.dumps(d) for d in stream.deltas(bad))  # held
    out = stream.deltas('}}\n</tool_call>\n<tool_call>\n{"name": "get_word", "arguments": {"word": "Upper"}}\n</tool_call>')
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert [c["function"]["arguments"] for c in calls] == ['{"word": "Upper"}']  # the valid one, whole
    assert any('"word": "lower"' in d.get("content", "") for d in out)  # the invalid one: content
