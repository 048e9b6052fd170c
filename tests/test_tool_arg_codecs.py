"""Argument codecs of the non-JSON tool-call formats (issue 62): Qwen3-Coder XML
(constrained/qwen_xml_args.py) and pythonic (constrained/pythonic_args.py), each checked
against the grammar xgrammar builds for it."""
from __future__ import annotations

import itertools
import json
import math

import jinja2.sandbox
import pytest
import xgrammar as xg

from constrained.pythonic_args import (kwargs_grammar, kwargs_grammar_is_exact, parse_calls,
                                        render_calls)
from constrained.qwen_xml_args import parse_parameters, render_parameters

# Verbatim from Qwen3-Coder-480B-A35B-Instruct's chat_template.jinja (assistant tool calls).
QWEN3_CODER_CALL = (
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "{%- for args_name, args_value in tool_call.arguments|items %}\n"
    "    {{- '<parameter=' + args_name + '>\\n' }}\n"
    "    {%- set args_value = args_value | tojson | safe if args_value is mapping or "
    "(args_value is sequence and args_value is not string) else args_value | string %}\n"
    "    {{- args_value }}\n"
    "    {{- '\\n</parameter>\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '</function>\\n</tool_call>' }}")
BEGIN, END = "<tool_call>\n<function=f>\n", "\n</function>\n</tool_call>"


def _template_call(arguments: dict) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # transformers' override: plain json.dumps, no HTML escaping, non-ASCII kept
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(QWEN3_CODER_CALL).render(tool_call={"name": "f", "arguments": arguments})


def _accepts(fmt: dict, text: str) -> bool:
    compiler = xg.GrammarCompiler(xg.TokenizerInfo([]), cache_enabled=False)
    compiled = compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    matcher = xg.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def _qwen_accepts(schema: dict, body: str) -> bool:
    content = {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"}
    return _accepts({"type": "tag", "begin": BEGIN, "content": content, "end": END}, body)


def _obj(props: dict, required=()) -> dict:
    return {"type": "object", "properties": props, "required": list(required)}


ALL_TYPES = _obj({
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
    "a": {"type": "array", "items": {"type": "string"}},
    "o": {"type": "object", "properties": {"k": {"type": "boolean"}, "v": {"type": "null"}}},
    "u": {"type": ["integer", "string"]}, "any": {},
    "e": {"enum": ["red", "dark blue", "7"]}, "c": {"const": 3},
    "opt": {"anyOf": [{"type": "number"}, {"type": "string"}]}}, ["s"])
QWEN_CASES = [
    (_obj({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name", "age"]),
     {"name": "Bob", "age": 100}),
    (ALL_TYPES, {"s": "x"}),
    (ALL_TYPES, {"s": "line 1\n  line 2\n", "i": -7, "n": 1e20, "a": ["p", "q\"<>&"],
                 "o": {"k": True, "v": None}, "u": 5, "any": {"deep": [1, {"x": "é"}]},
                 "e": "dark blue", "c": 3, "opt": 0.5}),
    (ALL_TYPES, {"s": "", "n": -0.25, "a": [], "o": {}, "u": "five", "any": "plain text",
                 "e": "7", "opt": "text"}),
    (ALL_TYPES, {"s": "\nleading and trailing newline\n", "i": 12345678901234567890,
                 "n": 3, "any": [True, None]}),
    (ALL_TYPES, {"s": "  </parameter  <parameter=s> 😀 {\"json\": 1} \\n \t"}),
]


@pytest.mark.parametrize("schema,args", QWEN_CASES)
def test_qwen_render_is_template_and_grammar_accepts_it(schema, args):
    text = render_parameters(args)
    assert BEGIN + text + "</function>\n</tool_call>" == _template_call(args)
    assert _qwen_accepts(schema, BEGIN + text[:-1] + END)  # the template's last "\n" is END's
    assert render_parameters(args, json_literals=True) == text  # no top-level bool / null here
    assert parse_parameters(text, schema) == args


BOOL_NULL = _obj({"b": {"type": "boolean"}, "z": {"type": "null"},
                  "bz": {"type": ["boolean", "null"]}, "any": {}})


@pytest.mark.parametrize("args", [{"b": True}, {"b": False, "z": None}, {"bz": None},
                                  {"bz": False, "any": True}])
def test_qwen_booleans_and_null_template_vs_grammar(args):
    # The template writes top-level scalars with |string (True / None); xgrammar's boolean
    # and null rules are JSON's (true / null). Both spellings parse to the same arguments.
    template, grammar = render_parameters(args), render_parameters(args, json_literals=True)
    assert BEGIN + template + "</function>\n</tool_call>" == _template_call(args)
    assert ("True" in template or "False" in template or "None" in template)
    typed = {k: v for k, v in args.items() if k != "any"}
    assert _qwen_accepts(BOOL_NULL, BEGIN + template[:-1] + END) == (not typed)
    assert _qwen_accepts(BOOL_NULL, BEGIN + grammar[:-1] + END)
    assert parse_parameters(template, BOOL_NULL) == args == parse_parameters(grammar, BOOL_NULL)


def test_qwen_no_arguments_template_vs_grammar():
    # The template writes "<function=f>\n</function>"; BEGIN and END carry one "\n" each.
    assert render_parameters({}) == ""
    assert _template_call({}) == BEGIN + "</function>\n</tool_call>"
    assert not _qwen_accepts(_obj({}), _template_call({}))
    assert _qwen_accepts(_obj({}), BEGIN + END)
    assert parse_parameters("", _obj({})) == {} == parse_parameters("\n \n", None)


def test_qwen_grammar_whitespace():
    schema = _obj({"s": {"type": "string"}, "i": {"type": "integer"}}, ["s", "i"])
    # any whitespace between parameters and around non-string values, none needed at all
    for body in ["<parameter=s>x</parameter><parameter=i>1</parameter>",
                 "  <parameter=s>\nx\n</parameter>\n\n\t<parameter=i> \n1\n\n</parameter>\n "]:
        assert _qwen_accepts(schema, BEGIN + body + END)
        assert parse_parameters(body, schema) == {"s": "x", "i": 1}
    # around a string value the whitespace is the string's own (the parser strips one "\n")
    assert parse_parameters("<parameter=s>\n\n x \n</parameter>", schema) == {"s": "\n x "}
    assert not _qwen_accepts(schema, BEGIN + "<parameter=i>1</parameter><parameter=s>x</parameter>" + END)


def test_qwen_parse_typing_rules():
    schema = _obj({"e": {"enum": ["a b", "true"]}, "u": {"type": ["integer", "string"]},
                   "n": {"type": "number"}, "any": {}}, [])
    p = lambda body: parse_parameters(body, schema)  # noqa: E731
    assert p("<parameter=e>\n  a b \n</parameter>") == {"e": "a b"}  # grammar allows padding
    assert p("<parameter=e>\ntrue\n</parameter>") == {"e": "true"}  # a string enum member
    assert p("<parameter=u>\n5\n</parameter>") == {"u": 5}  # union: JSON first
    assert p("<parameter=u>\n5x\n</parameter>") == {"u": "5x"}
    assert p("<parameter=any>\n5\n</parameter>") == {"any": 5}  # untyped: JSON if it parses
    assert p("<parameter=any>\nNone\n</parameter>") == {"any": None}
    assert p("<parameter=any>\n[1\n</parameter>") == {"any": "[1"}
    assert p("<parameter=n>\n7\n</parameter>") == {"n": 7}
    assert p("<parameter=extra>\n{\"a\": 1}\n</parameter>") == {"extra": {"a": 1}}
    assert p("<parameter=extra>\nhi\n</parameter>") == {"extra": "hi"}
    typed_extra = {"type": "object", "additionalProperties": {"type": "string"}}
    assert parse_parameters("<parameter=x>\n12\n</parameter>", typed_extra) == {"x": "12"}


@pytest.mark.parametrize("body,message", [
    ("<parameter=i>\n1\n", "not closed"),
    ("<parameter=i>\n1\n</parameter>\ngarbage", "expected '<parameter=NAME>'"),
    ("<parameter=i>\n1\n</parameter><parameter=i>\n2\n</parameter>", "appears twice"),
    ("<parameter=i>\nabc\n</parameter>", "expected integer"),
    ("<parameter=i>\n1.5\n</parameter>", "expected integer"),
    ("<parameter=b>\nyes\n</parameter>", "expected boolean"),
    ("<parameter=n>\nNaN\n</parameter>", "expected number"),
    ("<parameter=n>\n1e999\n</parameter>", "out of range"),
    ("<parameter=o>\n{\"a\": 1\n</parameter>", "expected object"),
])
def test_qwen_parse_errors(body, message):
    schema = _obj({"i": {"type": "integer"}, "b": {"type": "boolean"}, "n": {"type": "number"},
                   "o": {"type": "object"}})
    with pytest.raises(ValueError, match=message):
        parse_parameters(body, schema)


PY_SCHEMA = _obj({
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "note": {"type": ["string", "null"]},
    "unit": {"enum": ["C", "F", 0]}, "tags": {"type": "array", "items": {"type": "string"}},
    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    "meta": {"type": "object"}, "any": {}}, ["city", "days"])
PY_CASES = [
    {"city": "Paris", "days": 3},
    {"city": "São \"Paulo\"\n\t\\ 😀 \x01", "days": -1, "temp": 21.5, "metric": True,
     "note": None, "unit": "F", "tags": ["a", ""], "grid": [[1, 2], []],
     "meta": {"k": [False, None, 1e-05], "n": {}}, "any": "x"},
    {"city": "", "days": 0, "temp": 3, "note": "n", "unit": 0, "meta": {}, "any": [1, {"a": None}]},
]


def _py_accepts(schema: dict, text: str) -> bool:
    content = {"type": "grammar", "grammar": kwargs_grammar(schema)}
    return _accepts({"type": "tag", "begin": "[f(", "content": content, "end": ")]"}, text)


@pytest.mark.parametrize("args", PY_CASES)
def test_pythonic_round_trip_and_grammar(args):
    text = render_calls([("f", args)])
    assert _py_accepts(PY_SCHEMA, text)
    assert parse_calls(text) == [("f", args)]
    assert not kwargs_grammar_is_exact(PY_SCHEMA)


@pytest.mark.parametrize("text", [
    '[f(days=3)]',  # missing required
    '[f(city="x", days=3, extra=1)]',  # unknown keyword
    '[f(city="x", days="3")]',  # string for an integer
    '[f(city=1, days=3)]',  # integer for a string
    '[f(days=3, city="x")]',  # out of schema order
    '[f(city="x", days=3, unit="K")]',  # not in the enum
    '[f(city="x", days=3, tags=[1])]',  # typed array items
    '[f(city="x", days=3, metric=true)]',  # JSON, not Python
    "[f(city='x', days=3)]",  # single quotes: valid Python, outside the grammar
    '[f(city="\\/", days=3)]',  # \/ means backslash-slash to Python
    '[f(city="x",days=3)]',  # separator is ", "
])
def test_pythonic_grammar_rejects(text):
    assert not _py_accepts(PY_SCHEMA, text)


def test_pythonic_optional_subsets_in_order():
    schema = _obj({"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"},
                   "d": {"type": "integer"}}, ["c"])
    for n in range(5):
        for keys in itertools.combinations("abcd", n):
            text = render_calls([("f", {k: 1 for k in keys})])
            assert _py_accepts(schema, text) == ("c" in keys), text
    empty = _obj({})
    assert _py_accepts(empty, "[f()]") and not _py_accepts(empty, "[f(a=1)]")


def test_pythonic_parse_many_forms():
    calls = [("f", {"a": 1, "b": "x"}), ("g", {}), ("ns.tool", {"t": [1, [2]]})]
    assert parse_calls(render_calls(calls)) == calls
    assert render_calls(calls) == '[f(a=1, b="x"), g(), ns.tool(t=[1, [2]])]'
    assert parse_calls(" [f(a='s', b=(1, 2), c=-3.5, d={'k': None})] ") == [
        ("f", {"a": "s", "b": [1, 2], "c": -3.5, "d": {"k": None}})]
    assert parse_calls("[]") == []


@pytest.mark.parametrize("text,message", [
    ("f(a=1)", "must be a list"), ("[f(a=1]", "not valid Python"), ("[1]", "not a call"),
    ("[f(1)]", "positional"), ("[f(**x)]", r"\*\*kwargs"), ("[f(a=x)]", "argument 'a'"),
    ("[f(a={1})]", "set is not a JSON value"), ("[f(a=b'x')]", "bytes"),
    ("[f(a={1: 2})]", "keys must be strings"), ("[f()()]", "plain function name"),
    ("[f(a=1, a=2)]", "repeat|not valid Python"), ("[f(a=1e999)]", "not a JSON number"),
])
def test_pythonic_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_calls(text)


def test_pythonic_render_and_grammar_errors():
    for calls in ([("get-weather", {})], [("f", {"class": 1})], [("f", {"a b": 1})],
                  [("f", {"a": math.nan})], [("f", {"a": {1, 2}})]):
        with pytest.raises(ValueError):
            render_calls(calls)
    with pytest.raises(ValueError, match="not a Python identifier"):
        kwargs_grammar(_obj({"from": {"type": "string"}}))
