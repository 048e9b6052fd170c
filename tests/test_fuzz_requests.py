"""Seeded fuzz test of the HTTP API, through the session's REAL server (``server`` fixture:
``python launch.py``, embedded SmolLM2 on CPU, xgrammar, --enable-custom-logit-processor).

A ``random.Random(SEED)`` generator builds well over 1,000 malformed or hostile requests
for every endpoint (POST /generate, /v1/completions, /v1/chat/completions, /abort_request;
GET /v1/models, /health, /health_generate, /get_server_info, /get_model_info; wrong
methods and unknown paths): broken / truncated / non-UTF-8 / deeply nested JSON, wrong
types for every field, NaN / Infinity / 1e309 / huge integers, lone surrogates, giant
prompts, hostile grammars (catastrophic regexes, empty-language and self-referencing
schemas, contradictory bounds, huge enums, external ``$ref``s), logit_bias and stop-list
abuse, bad chat messages, edge sampling values and unknown fields. They are sent on 8
threads; then a few sequential scenarios: streams cut off by the client, a client that
disconnects, admin aborts of running requests, a duplicate request id, and "loop blockers"
(requests that are cheap to send but costly to serve, each sent alone while /health is
timed every 50 ms: none may hold the event loop longer than LOOP_BLOCK_MAX_S).

It asserts:
  * no response >= 500, no hang (every request answers within REQUEST_TIMEOUT_S), no
    broken stream (a 200 stream must end with ``data: [DONE]``);
  * every 4xx of an API route has OpenAI's ``{"error": {"message": ...}}`` with a specific
    message (not empty, not a bare phrase like "Bad Request", not leaked Python internals
    such as "... is not a valid HTTPStatus"); 404/405 for unknown paths / wrong methods
    may keep Starlette's default body, but must have one;
  * every 2xx is valid JSON (or SSE for streams);
  * /health stays responsive during the run, is 200 afterwards, no request is left in
    flight, and a greedy /generate gives exactly the same tokens as before the fuzz.

Valid requests generate at most 4 tokens (constrained ones at most 8) so the run is short
(see the printed summary: ``pytest -s tests/test_fuzz_requests.py``).

``KNOWN_PRODUCT_BUGS`` can hold back the cases of a bug found here until it is fixed
(they are counted and listed in the summary). It is empty: the nine bugs this test first
found (lone surrogates, 64-bit overflow, chat_template_kwargs, status 499, errors after a
stream started, logit_bias keys, 4,300-digit integers) are fixed.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import random
import re
import threading
import time
from typing import Any, Callable, Optional

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

SEED = 0x5EED_F022
MIN_CASES = 1000
N_RANDOM_CASES = 500  # on top of the ~1,400 hand-written hostile cases
WORKERS = 8
REQUEST_TIMEOUT_S = 30.0
HEALTH_MAX_LATENCY_S = 10.0  # /health must answer within this while the fuzz runs
FUZZ_BUDGET_S = 180.0  # the whole fuzz (all phases) must take less than this (~60 s idle on AVX512-BF16, ~120 s on a 2-vCPU AVX2 machine in fp32)
# TP=2 (tp2_server, test_fuzz_requests_tp2): a seeded subset, bounded in time.
TP2_FRACTION = 0.08  # of each category's cases (scenarios: all; loop blockers: none)
TP2_API_FRACTION = 0.2  # of the newer API fields' cases (categories api_*)
TP2_MIN_PER_CATEGORY = 3
TP2_DEADLINE_S = 15.0  # concurrent cases not started by then are not sent (counted in the summary)
TP2_BUDGET_S = 75.0  # deadline + the slowest case (REQUEST_TIMEOUT_S) + scenarios
GREEDY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}

JSON_CT = {"Content-Type": "application/json"}
GET_ROUTES = ("/v1/models", "/health", "/health_generate", "/get_server_info", "/get_model_info")
POST_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request")
GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
DISALLOW = '{"callable": "sampling.custom_logit_processor:DisallowedTokensLogitsProcessor"}'
VOCAB = 49152  # SmolLM2's vocabulary (token ids out of range are what matters here)
BIG = 10**9  # a max-token count far over the context (never a long generation)


# ---- known product bugs ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KnownBug:
    name: str
    summary: str
    matches: Callable[["Case"], bool]


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # inside JSON text sent as a string


def _has_surrogate(v: Any) -> bool:
    if isinstance(v, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in v) or _SURROGATE_ESCAPE.search(v) is not None
    if isinstance(v, dict):
        return any(_has_surrogate(k) or _has_surrogate(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return any(_has_surrogate(x) for x in v)
    return False


def _has_wire_overflow_int(v: Any) -> bool:
    """An int msgpack cannot carry (outside [-2**63, 2**64-1])."""
    if isinstance(v, int) and not isinstance(v, bool):
        return not -2**63 <= v <= 2**64 - 1
    if isinstance(v, dict):
        return any(_has_wire_overflow_int(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_wire_overflow_int(x) for x in v)
    return False


def _sampling_fields(case: "Case") -> dict:
    """The fields that reach SamplingParams (native: sampling_params; OpenAI: top level)."""
    obj = case.obj if isinstance(case.obj, dict) else {}
    if case.path == "/generate":
        sp = obj.get("sampling_params")
        return sp if isinstance(sp, dict) else {}
    return obj


def _prompt_text_has_surrogate(case: "Case") -> bool:
    """A lone surrogate in the text that is tokenized (prompt, message contents)."""
    obj = case.obj if isinstance(case.obj, dict) else {}
    if case.path == "/generate":
        return _has_surrogate(obj.get("text"))
    if case.path == "/v1/completions":
        return _has_surrogate(obj.get("prompt"))
    if case.path == "/v1/chat/completions" and isinstance(obj.get("messages"), list):
        return any(isinstance(m, dict) and _has_surrogate(m.get("content")) for m in obj["messages"])
    return False


# Fields the frontend forwards to the scheduler (msgpack) as they are.
_FORWARDED = ("stop", "regex", "ebnf", "choice", "json_schema", "structural_tag", "custom_params")


def _surrogate_forwarded_or_echoed(case: "Case") -> bool:
    """A lone surrogate where the server msgpack-encodes it for the scheduler, or echoes it
    in its reply or in an error message without escaping it."""
    if case.path not in GENERATE_ROUTES or not isinstance(case.obj, dict):
        return False
    obj, sp = case.obj, _sampling_fields(case)
    if any(_has_surrogate(sp.get(f)) for f in _FORWARDED):
        return True
    rf = sp.get("response_format")
    if isinstance(rf, dict) and (_has_surrogate(rf.get("json_schema")) or
                                 (rf.get("type") == "structural_tag" and _has_surrogate(rf))):
        return True
    if case.path == "/generate":  # the rid, and unknown field names (listed in the message)
        return _has_surrogate(obj.get("rid")) or _has_surrogate(list(obj)) or _has_surrogate(list(sp))
    return _has_surrogate(obj.get("model"))  # echoed in every reply


def _wire_overflow_fields(case: "Case") -> bool:
    """top_k or a custom_params value (other than the checked token_ids) beyond msgpack's ints."""
    sp = _sampling_fields(case)
    top_k, cp = sp.get("top_k"), sp.get("custom_params")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 2**64 - 1:
        return True
    return isinstance(cp, dict) and _has_wire_overflow_int({k: v for k, v in cp.items() if k != "token_ids"})


def _chat_template_kwargs(case: "Case") -> dict:
    obj = case.obj if isinstance(case.obj, dict) else {}
    kw = obj.get("chat_template_kwargs") if case.path == "/v1/chat/completions" else None
    return kw if isinstance(kw, dict) else {}


# Each entry: the cases it matches are not sent. Empty this list when they are fixed.
KNOWN_PRODUCT_BUGS: list[KnownBug] = [
]


def _int_ok(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def _logit_bias_keys(case: "Case") -> list:
    lb = _sampling_fields(case).get("logit_bias")
    return list(lb) if isinstance(lb, dict) else []


# ---- cases ----------------------------------------------------------------------------
class Raw:
    """JSON text spliced in verbatim (1e309, a 5,000-digit int, 20,000-deep brackets)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def dumps(obj: Any) -> bytes:
    """JSON with NaN/Infinity literals allowed, lone surrogates as \\ud800 escapes and
    ``Raw`` values spliced in."""
    raws: list[str] = []

    def default(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        raise TypeError(type(o).__name__)

    text = json.dumps(obj, default=default)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text.encode()


@dataclasses.dataclass
class Case:
    category: str
    name: str
    method: str
    path: str
    body: Optional[bytes] = None
    headers: dict = dataclasses.field(default_factory=dict)
    obj: Any = None  # the object the body was made from (None for raw byte bodies)
    route_case: bool = False  # unknown path / wrong method: 404/405 with any body is fine
    runner: Optional[Callable] = None  # special scenarios (sequential): runner(base) -> [Result]

    def short(self) -> str:
        body = self.body or b""
        shown = body[:200].decode("utf-8", "backslashreplace")
        more = f"... ({len(body)} bytes)" if len(body) > 200 else ""
        return _safe(f"[{self.category}] {self.name}: {self.method} {self.path} {shown}{more}")


def _json_case(category: str, name: str, path: str, obj: Any, method: str = "POST",
               headers: Optional[dict] = None) -> Case:
    return Case(category, name, method, path, dumps(obj), dict(JSON_CT if headers is None else headers), obj)


def _base(path: str, n: int = 4) -> dict:
    if path == "/generate":
        return {"text": "Hello", "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if path == "/v1/completions":
        return {"model": "smollm2", "prompt": "Hello", "max_tokens": n, "temperature": 0}
    if path == "/v1/chat/completions":
        return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": n,
                "temperature": 0}
    if path == "/abort_request":
        return {"rid": "no-such-request"}
    raise AssertionError(path)


def _with_sampling(path: str, fields: dict, n: int = 4) -> dict:
    """The base request of ``path`` with ``fields`` as sampling parameters (where each API
    takes them: native sampling_params or OpenAI top level)."""
    obj = _base(path, n)
    if path == "/generate":
        obj["sampling_params"].update(fields)
    else:
        obj.update(fields)
    return obj


# Value pools ---------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800", "x" * 50 + "\udbff", "\ud83d"]  # lone halves
WRONG_TYPES = [None, True, False, 0, -1, 1, 3.5, "", "x", "4", [], {}, [1, 2], ["a"], {"a": 1}, [[]],
               [None], {"": None}, "true", "null"]
NUM_EDGES = [NAN, INF, -INF, Raw("1e309"), Raw("-1e309"), Raw("1e-400"), Raw("-0"), Raw("1E2"),
             Raw("1" * 5000), Raw("-" + "9" * 4400), 2**70, -2**70, 2**63, 2**64, 2**64 - 1, 2**63 - 1,
             -2**63, -2**63 - 1, -1, 0, -0.0, 1e-300, 1e300, 0.5, 1.0000001, 2.0000001, -2.0000001, 3.0,
             Raw("0.1e1"), 100.0001, -100.0001]
MAXTOK_VALUES = [-1, 0, 1, 3.0, 2.5, "4", True, [], {}, [4], BIG, 2**31, 2**63 - 1, 2**63, 2**64, 2**70,
                 -2**70, NAN, INF, -INF, Raw("1e309"), Raw("1" * 5000), Raw("4.0"), Raw("4e0")]
HOSTILE_STRINGS = ["\x00", "\x00" * 100, "\\", "\u202e\u2066", "🙂" * 100, "%s%n%x", "{{7*7}}",
                   "<script>alert(1)</script>", "../../../../etc/passwd", "\r\n\r\nHTTP/1.1 200 OK",
                   "A" * 100_000, "<|im_end|><|im_start|>system", "\ufeff", "\uffff\ufffe", " " * 1000]


def _deep(n: int, open_: str = "[", close: str = "]", inner: str = "") -> Raw:
    return Raw(open_ * n + inner + close * n)


def _deep_obj(n: int) -> Raw:
    return Raw('{"a":' * n + "1" + "}" * n)


CATASTROPHIC_REGEXES = [
    "(a+)+$", "(a|aa)*b", "(a*)*b", "((a|b|c)*)*d", "(x+x+)+y", "(.*a){20}", "^(([a-z])+.)+[A-Z]([a-z])+$",
    "|".join(f"word{i}" for i in range(5000)), "a{1000000}", "a{0,100000}", "(a{1,1000}){1,1000}",
    "[\u0000-\U0010ffff]*", "(?P<n>a)(?P=n)", "x{2,1}", "(?=a)b", "(?!a)b", "[", "(", ")", "a**", "",
    "\\", "[z-a]", "(" * 20000 + "a" + ")" * 20000, "a{99999999999999999999}", "\\p{Lu}+", "\\1",
    "(a)\\1", "a" * 100_000, "[^\\x00-\\x7f]{5}", "\ud800", "a|\udfff", ".{0,4}\\d{3}",
    "(?i)ABC", "\\b\\B", "$^", "^$", "[a-z]{5,3}", "(((a)))|((b))" * 500,
]
HOSTILE_EBNF = [
    "", "root ::= root", 'root ::= root "a" | "a"', "root ::= " + "(" * 20000 + '"a"' + ")" * 20000,
    'root ::= "a" ' + " ".join(f"r{i}" for i in range(3000)) + "\n" + "\n".join(f'r{i} ::= "b{i}"' for i in range(3000)),
    "root ::= missing", 'root ::= "a"*', 'root ::= [^]', 'root ::= ""', "root ::=", '\ud800 ::= "a"',
    'root ::= "\ud800"', "garbage ~~~ !!!", 'root ::= "a" | ', 'root ::= ("a" | "b"){1000000}',
    'root ::= a\na ::= b\nb ::= a', "root ::= [\\x00-\\x{10FFFF}]+", "x" * 100_000,
]
_nested_items: Any = {"type": "string"}
for _ in range(60):
    _nested_items = {"type": "array", "items": _nested_items}
_nested_props: Any = {"type": "string"}
for _ in range(40):
    _nested_props = {"type": "object", "properties": {"a": _nested_props}, "required": ["a"]}
HOSTILE_SCHEMAS: list[Any] = [
    {"$ref": "#"}, {"not": {}}, False, True, {}, {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1},
    {"type": "string", "minLength": 10, "maxLength": 1}, {"type": "array", "minItems": 5, "maxItems": 1},
    {"type": "object", "minProperties": 5, "maxProperties": 1}, {"enum": [f"value-{i}" for i in range(5000)]},
    {"enum": []}, {"enum": [None, NAN, INF]}, {"const": NAN}, {"$ref": "http://169.254.169.254/latest/meta-data"},
    {"$ref": "file:///etc/passwd"}, {"properties": {"a": {"$ref": "https://evil.example/s.json"}}},
    {"$defs": {"x": {"$dynamicRef": "//evil"}}, "$ref": "#/$defs/x"}, {"type": "string", "pattern": "(a+)+$"},
    {"type": "string", "pattern": "(a|aa)*b"}, {"type": "string", "minLength": 100000},
    {"type": "array", "minItems": 1000000}, {"type": "integer", "minimum": 1e308},
    {"type": "number", "minimum": NAN}, {"type": "number", "maximum": INF}, {"type": "integer", "minimum": 2**70},
    {"type": "string", "maxLength": 2**70}, {"type": "string", "maxLength": -1},
    {"type": "object", "required": ["a"], "properties": {}, "additionalProperties": False},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, {"$ref": "#/nonexistent"}, {"$ref": "#/"},
    {"$ref": 5}, {"anyOf": []}, {"oneOf": []}, {"allOf": []}, {"type": []}, {"type": ["string", "bogus"]},
    {"multipleOf": 0}, {"type": "number", "multipleOf": -1}, {"type": "nonsense"},
    {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"type": "string", "format": "bogus"},
    {"type": "string", "pattern": "\ud800"}, {"enum": ["\ud800"]}, {"\ud800": 1},
    {"type": "integer", "minimum": 1, "maximum": 10**30}, {"type": "number", "multipleOf": 1e-300},
    {"type": "array", "items": False, "minItems": 1}, {"const": {"a": [1, 2, {"b": None}]}},
    {"type": "string", "pattern": "a{1000000}"}, {"type": "array", "prefixItems": [{"type": "integer"}] * 2000},
    _nested_items, _nested_props,
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
     "required": [f"p{i}" for i in range(2000)]},
    {"type": "object", "patternProperties": {"(a+)+$": {"type": "string"}}}, {"if": {}, "then": False, "else": False},
    {"type": "object", "dependentRequired": {"a": ["b"], "b": ["a"]}, "required": ["a"], "additionalProperties": False},
    {"uniqueItems": True, "type": "array", "items": {"enum": [1]}, "minItems": 2},
    {"type": "array", "contains": {"not": {}}}, {"type": "object", "propertyNames": {"pattern": "(a|aa)*b"}},
    {"properties": {"enum": {"$ref": "http://evil.example/"}}}, {"$schema": "http://json-schema.org/draft-99/schema"},
    "not json at all", "{" * 100 + "}" * 100, "[" * 20000 + "]" * 20000, '{"type": "string"', "", "null", "[]", "1",
    '{"type": "integer", "minimum": NaN}', '{"type": "string", "pattern": "\\ud800"}', _deep(20000), _deep_obj(20000),
    Raw('{"type": "integer", "maximum": 1e309}'), Raw('{"type": "integer", "minimum": ' + "9" * 5000 + "}"),
]
HOSTILE_CHOICES: list[Any] = [
    [], [""], ["a", ""], [None], [1, 2], "yes", {"a": 1}, [[]], [f"c{i}" for i in range(1024)],
    [f"c{i}" for i in range(1025)], [f"c{i}" for i in range(100_000)], ["x" * 3000] * 3, ["\ud800"], ["a", "a"],
    ["\x00"], [" "] * 1000, ["yes", "no"], ["(a+)+$", "[", "\\"],
]
HOSTILE_STRUCTURAL_TAGS: list[Any] = [
    {}, [], "x", {"structures": [], "triggers": []},
    {"structures": [{"begin": "<a>", "schema": {"not": {}}, "end": "</a>"}], "triggers": ["<a"]},
    {"structures": [{"begin": "<a>", "schema": {"$ref": "#"}, "end": "</a>"}], "triggers": ["<a"]},
    {"structures": [{"begin": "<a>", "schema": {"$ref": "http://evil.example/"}, "end": "</a>"}], "triggers": ["<a"]},
    {"format": {"type": "bogus"}}, {"format": None}, {"structures": [{"begin": "", "schema": {}, "end": ""}], "triggers": [""]},
    {"structures": [{"begin": "\ud800", "schema": {}, "end": "x"}], "triggers": ["\ud800"]},
    {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}] * 2000, "triggers": ["<a"]},
    {"structures": "x", "triggers": 1}, {"structures": [1], "triggers": [2]}, _deep_obj(20000),
    '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}', "not json",
]
HOSTILE_RESPONSE_FORMATS: list[Any] = [
    {}, {"type": None}, {"type": "bogus"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "http://evil.example/"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_obj(20000)}},
    {"type": "json_schema", "json_schema": "x"}, {"type": "json_object"}, {"type": "text"},
    {"type": "structural_tag"}, {"type": "structural_tag", "structures": [], "triggers": []},
    {"type": "json_object", "json_schema": {"schema": {"type": "string"}}}, {"type": ["json_object"]},
    {"type": {"a": 1}}, {"type": "\ud800"},
]
STOP_VALUES: list[Any] = [
    "", [""], ["a", ""], [1, 2], [None], {"a": 1}, [["a"]], True, 5, ["\ud800"], "\ud800",
    [f"stop{i}" for i in range(10_000)], ["x" * 1_000_000], "y" * 200_000, ["x" * 10_000] * 50,
    ["\x00"], [" "], ["\n"], ["Hello"], ["<|im_end|>"], ["a"] * 10_000, [NAN], [[]],
]
STOP_TOKEN_IDS: list[Any] = [
    [-1], [VOCAB], [2**70], [-2**70], [2**63], ["1"], [1.5], [True], [None], [NAN], "1,2", 3, {"a": 1},
    list(range(VOCAB)), list(range(100_000)), [[1]], [0] * 10_000, [],
]
LOGIT_BIASES: list[Any] = [
    {"99999999": 1}, {str(VOCAB): 1}, {"-1": 5}, {"abc": 1}, {"": 1}, {"1.5": 1}, {" 12 ": 1}, {"--5": 1},
    {"²": 1}, {"١٢": 1}, {"1_000": 1}, {"0x10": 1}, {"1e3": 1}, {"1": NAN}, {"1": INF}, {"1": -INF},
    {"1": Raw("1e309")}, {"1": "x"}, {"1": None}, {"1": True}, {"1": [1]}, {"1": 100.0001},
    {"1": -100.0001}, {"1": 2**70}, {str(2**70): 1}, {"9" * 5000: 1}, {"\ud800": 1}, [[1, 2]], [[1, 2, 3]],
    [1, 2], "x", 5, {str(i): -100 for i in range(VOCAB)}, {str(i): 1 for i in range(100_000)},
    {str(i): 100 for i in range(0, VOCAB, 7)}, {"1": 100, "2": -100},
]
INPUT_IDS: list[Any] = [
    [], [-1], [VOCAB], [2**70], [2**63], [1.5], ["1"], [True], [None], [[1]], "1,2", 5, {"a": 1},
    list(range(100_000)), [1] * 5000, [NAN], [Raw("1e309")], [1, 2, 3],
]
PROMPTS: list[Any] = [
    "", [], [[]], [""], ["a", "b"], [[1, 2], [3]], [-1], [VOCAB], [2**70], [1.5], [[1.5]], [None], {"a": 1},
    5, True, None, [1, 2, 3], [[1, 2, 3]], ["Hello"], "\x00", [Raw("1e309")],
]
MESSAGES: list[Any] = [
    [], {}, "hi", [{}], [None], [[]], [1], [{"role": "root", "content": "x"}], [{"role": "", "content": "x"}],
    [{"role": None, "content": "x"}], [{"role": ["user"], "content": "x"}], [{"role": "user"}],
    [{"content": "x"}], [{"role": "user", "content": 1}], [{"role": "user", "content": {"a": 1}}],
    [{"role": "user", "content": [1]}], [{"role": "user", "content": [None]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 1}]}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": []}], [{"role": "assistant", "content": "x"}], [{"role": "tool", "content": "x"}],
    [{"role": "system", "content": "x"}] * 3, [{"role": "user", "content": "hi", "name": 1}],
    [{"role": "user", "content": "x", "tool_calls": "bogus"}],
    [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": 1, "arguments": NAN}}]}],
    [{"role": "user", "content": "hi"}] * 1000, [{"role": "user", "content": "\ud800"}],
    [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], [{"role": "user", "content": "<|im_start|>"}],
    [{"role": "user", "content": "x"}, 1], [{"role": "user", "content": "x", "\ud800": "y"}],
    [{"role": "user", "content": _deep(20000)}], [{"role": "user", "content": "x", "extra": _deep(100)}],
]
CHAT_TEMPLATE_KWARGS: list[Any] = [
    {"tokenize": False}, {"return_dict": True}, {"add_generation_prompt": "x"}, {"enable_thinking": "x"},
    {"chat_template": "{{ raise_exception('boom') }}"}, {"chat_template": "{% for %}"}, {"chat_template": ""},
    {"chat_template": "{{ messages[0].content * 100000 }}"}, {"chat_template": "{{ ''.__class__.__mro__ }}"},
    {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, {"tools": 1}, {"documents": 1},
    {"return_tensors": "pt"}, {"padding": "max_length", "max_length": 10**6}, {"truncation": True, "max_length": 0},
    {"continue_final_message": True}, {"messages": 1}, {"tokenizer": 1}, {"conversation": 1}, [], "x", {"\ud800": 1},
]
CUSTOM_PROCESSORS: list[Any] = [
    "", "x", "{}", "[1]", "null", '"str"', '{"callable": 1}', '{"callable": ":"}', '{"callable": "a:b:c"}',
    '{"callable": "nonexistent_module_f7c1:Foo"}', '{"callable": "json:loads"}', '{"callable": "os:path"}',
    '{"callable": "..:x"}', '{"callable": "sampling.custom_logit_processor:CustomLogitProcessor"}',
    '{"callable": "sampling.custom_logit_processor:_load"}', '{"callable": "sampling.custom_logit_processor:nope"}',
    '{"callable": "sampling.custom_logit_processor:DisallowedTokensLogitsProcessor.__init__"}',
    "[" * 20000 + "]" * 20000, '{"callable": "\ud800:x"}', 5, [DISALLOW], {"callable": "x:y"},
]
CUSTOM_PARAMS: list[Any] = [
    {"token_ids": [-1]}, {"token_ids": [VOCAB]}, {"token_ids": ["a"]}, {"token_ids": [True]}, {"token_ids": 5},
    {"token_ids": list(range(VOCAB))}, {"token_ids": [2**70]}, {"token_ids": [1], "extra": 2**70},
    {"token_ids": [1], "x": "\ud800"}, {"token_ids": [1], "deep": _deep(100)}, {"token_ids": [1], "deep": _deep(20000)},
    {}, [], "x", {"token_ids": [NAN]}, {"token_ids": [1], "f": NAN},
]
GOOD_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
GOOD_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": GOOD_PARAMS}}
TOOLS: list[Any] = [
    [], [{}], [None], [1], ["x"], {"type": "function"}, [{"type": "function"}], [{"type": "bogus", "function": {"name": "f"}}],
    [{"type": "function", "function": {}}], [{"type": "function", "function": None}],
    [{"type": "function", "function": {"name": 1}}], [{"type": "function", "function": {"name": ""}}],
    [{"type": "function", "function": {"name": "x" * 10_000}}], [{"type": "function", "function": {"name": "\ud800"}}],
    [{"type": "function", "function": {"name": "a b/c\"<>"}}], [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    [{"type": "function", "function": {"name": "f", "parameters": []}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "http://evil.example/"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(a+)+$"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": _nested_props}}],
    [{"type": "function", "function": {"name": "f", "parameters": _deep_obj(20000)}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
    [{"type": "function", "function": {"name": "f", "strict": "yes", "parameters": GOOD_PARAMS}}],
    [{"type": "function", "function": {"name": "f", "description": 5}}],
    [GOOD_TOOL, GOOD_TOOL], [GOOD_TOOL] * 1000,
    [{"type": "function", "function": {"name": f"f{i}", "parameters": GOOD_PARAMS}} for i in range(500)],
    [GOOD_TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}],
    [{**GOOD_TOOL, "extra": _deep(20000)}], [GOOD_TOOL],
]
TOOL_CHOICES: list[Any] = [
    "none", "auto", "required", "bogus", "", "\ud800", "REQUIRED", {}, [], 1, True,
    {"type": "function"}, {"type": "function", "function": {}}, {"type": "function", "function": {"name": 1}},
    {"type": "function", "function": {"name": "unknown_function"}}, {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "get_weather", "arguments": _deep(20000)}},
    {"type": "bogus", "function": {"name": "get_weather"}}, {"function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "x" * 100_000}}, {"type": "function", "function": "get_weather"},
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [1]}}, {"type": "custom", "custom": {"name": "x"}},
]
STRUCTURED_OUTPUTS: list[Any] = [
    {}, {"json": None}, {"json": 5}, {"json": "not json"}, {"json": "{" * 100}, {"json": {"$ref": "#"}},
    {"json": {"type": "integer", "minimum": 5, "maximum": 1}}, {"json": {"$ref": "http://169.254.169.254/"}},
    {"json": _deep_obj(20000)}, {"json": '{"type": "integer", "minimum": ' + "9" * 5000 + "}"},
    {"regex": "(a+)+$"}, {"regex": "["}, {"regex": 5}, {"regex": "a{1000000}"}, {"choice": []}, {"choice": [""]},
    {"choice": "yes"}, {"choice": [1]}, {"choice": [f"c{i}" for i in range(100_000)]}, {"grammar": ""},
    {"grammar": "root ::= root"}, {"grammar": 5}, {"json_object": "x"}, {"json_object": True}, {"json_object": False},
    {"structural_tag": "not json"}, {"structural_tag": {"structures": [1]}}, {"structural_tag": _deep_obj(20000)},
    {"json": {"type": "string"}, "regex": "a"}, {"regex": "a", "choice": ["a"]}, {"backend": "xgrammar"},
    {"bogus": 1}, {"regex": "a", "disable_any_whitespace": True}, {"json": {}, "disable_any_whitespace": "x"},
    {"json": {}, "whitespace_pattern": "(a+)+$"}, {"json": {}, "whitespace_pattern": "["},
    {"json": {}, "whitespace_pattern": 5}, {"json": _nested_props, "disable_additional_properties": True},
    {"json": {"allOf": [{"properties": {"a": {}}}]}, "disable_additional_properties": True},
    {"json": {}, "disable_additional_properties": [1]}, {"regex": "\ud800"}, {"json": {"enum": ["\ud800"]}},
    {"disable_any_whitespace": True}, {"whitespace_pattern": " "}, "x", [], 5, _deep(20000),
]
RF_STRICT: list[Any] = [
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": "yes", "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": 1, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": None, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": [True], "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": False, "schema": {"$ref": "#"}}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": {"not": {}}}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": _deep_obj(20000)}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": "str"}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True}},
    {"type": "json_schema", "json_schema": {"strict": True, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": 5, "strict": True, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "x" * 100_000, "strict": True, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "\ud800", "strict": True, "schema": GOOD_PARAMS}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": GOOD_PARAMS, "bogus": 1}},
    {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": {"type": "integer", "minimum": 2**70}}},
    {"type": "json_schema", "strict": True, "json_schema": {"name": "s", "schema": GOOD_PARAMS}},
]
STREAM_OPTIONS: list[Any] = [
    {}, {"include_usage": True}, {"include_usage": "x"}, {"include_usage": None}, {"include_usage": 2},
    {"include_usage": [True]}, {"include_usage": True, "include_obfuscation": "x"}, {"continuous_usage_stats": True},
    {"include_usage": True, "bogus": 1}, "x", [], 5, True, _deep_obj(20000),
]
UNKNOWN_KEYS = ["foo", "", "__proto__", "constructor", "\ud800", "🙂", "x" * 10_000, "max_new_token", "Temperature",
                "sampling_params", "prompt", "messages", "text", "best_of", "functions", "api_key", " model"]


def _pool_for(kind: str) -> list[Any]:
    return {
        "maxtok": MAXTOK_VALUES, "int": NUM_EDGES + WRONG_TYPES, "float": NUM_EDGES + WRONG_TYPES,
        "bool": WRONG_TYPES + NUM_EDGES[:6], "str": WRONG_TYPES + SURROGATES + HOSTILE_STRINGS,
        "stop": STOP_VALUES + WRONG_TYPES, "ids": STOP_TOKEN_IDS + WRONG_TYPES, "bias": LOGIT_BIASES + WRONG_TYPES,
        "schema": HOSTILE_SCHEMAS + WRONG_TYPES, "regex": CATASTROPHIC_REGEXES + WRONG_TYPES,
        "ebnf": HOSTILE_EBNF + WRONG_TYPES, "choice": HOSTILE_CHOICES, "stag": HOSTILE_STRUCTURAL_TAGS,
        "rf": HOSTILE_RESPONSE_FORMATS + WRONG_TYPES, "clp": CUSTOM_PROCESSORS, "cparams": CUSTOM_PARAMS + WRONG_TYPES,
        "messages": MESSAGES + WRONG_TYPES, "prompt": PROMPTS, "input_ids": INPUT_IDS,
        "ctkw": CHAT_TEMPLATE_KWARGS + WRONG_TYPES, "dict": [w for w in WRONG_TYPES if w != {}] + [_deep(20000)],
        "list": WRONG_TYPES + [[{"type": "function", "function": {"name": "f"}}]],
        "text": SURROGATES + HOSTILE_STRINGS + WRONG_TYPES,
        "tools": TOOLS + WRONG_TYPES, "tool_choice": TOOL_CHOICES + WRONG_TYPES,
        "so": STRUCTURED_OUTPUTS + WRONG_TYPES, "rf_strict": RF_STRICT + HOSTILE_RESPONSE_FORMATS,
        "stream_options": STREAM_OPTIONS + WRONG_TYPES, "lp_start": LOGPROB_START_LENS + WRONG_TYPES,
    }[kind]


LOGPROB_START_LENS: list[Any] = [-2, -1, 0, 1, 2, 3, 100, 2**31, 2**63, 2**70, -2**70, 1.0, 1.5, "0", NAN]


SAMPLING_KINDS = {
    "min_new_tokens": "int", "stop": "stop", "stop_token_ids": "ids", "ignore_eos": "bool", "temperature": "float",
    "top_p": "float", "top_k": "int", "min_p": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "repetition_penalty": "float", "logit_bias": "bias", "seed": "int", "skip_special_tokens": "bool", "n": "int",
    "json_schema": "schema", "regex": "regex", "ebnf": "ebnf", "choice": "choice", "structural_tag": "stag",
    "custom_params": "cparams",
}
GENERATE_TOP_KINDS = {"text": "text", "input_ids": "input_ids", "stream": "bool", "rid": "str",
                      "custom_logit_processor": "clp", "require_reasoning": "bool", "sampling_params": "dict",
                      "return_logprob": "bool", "top_logprobs_num": "int", "logprob_start_len": "lp_start",
                      "return_text_in_logprobs": "bool"}
OPENAI_KINDS = {
    "model": "str", "max_tokens": "maxtok", "temperature": "float", "top_p": "float", "n": "int", "stop": "stop",
    "seed": "int", "stream": "bool", "stream_options": "stream_options", "user": "str", "frequency_penalty": "float",
    "presence_penalty": "float", "logit_bias": "bias", "top_k": "int", "min_p": "float", "min_tokens": "int",
    "stop_token_ids": "ids", "ignore_eos": "bool", "skip_special_tokens": "bool", "repetition_penalty": "float",
    "regex": "regex", "ebnf": "ebnf", "choice": "choice", "response_format": "rf_strict", "custom_logit_processor": "clp",
    "custom_params": "cparams", "structured_outputs": "so", "guided_json": "schema", "guided_regex": "regex",
    "guided_choice": "choice", "guided_grammar": "ebnf", "guided_whitespace_pattern": "regex",
    "guided_decoding_backend": "str",
}
CHAT_KINDS = {**OPENAI_KINDS, "messages": "messages", "max_completion_tokens": "maxtok", "logprobs": "bool",
              "top_logprobs": "int", "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "bool",
              "chat_template_kwargs": "ctkw", "modalities": "list", "audio": "dict", "prediction": "dict",
              "metadata": "dict", "store": "bool", "service_tier": "str"}
COMPLETION_KINDS = {**OPENAI_KINDS, "prompt": "prompt", "echo": "bool", "suffix": "str", "best_of": "int",
                    "logprobs": "int", "json_schema": "schema"}


class FuzzGen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.cases: list[Case] = []
        self._n = 0

    def add(self, case: Case) -> None:
        self.cases.append(case)

    def uid(self) -> str:
        self._n += 1
        return f"fuzz-{self._n}"

    # -- hand-written hostile cases --------------------------------------------------
    def grammars(self) -> None:
        """Every hostile constraint once, on the generating endpoints in turn (the grammar
        backend sees the same spec whichever API carried it); 8 tokens at most."""
        def on(i: int) -> str:
            return GENERATE_ROUTES[i % len(GENERATE_ROUTES)]

        for i, spec in enumerate(HOSTILE_SCHEMAS):
            path = on(i)
            if path == "/v1/chat/completions" and isinstance(spec, (dict, bool)):
                rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": spec, "strict": True}}
                self.add(_json_case("grammar", f"schema#{i} response_format", path,
                                    _with_sampling(path, {"response_format": rf}, 8)))
                continue
            path = "/generate" if path == "/v1/chat/completions" else path  # chat takes no json_schema
            self.add(_json_case("grammar", f"schema#{i}", path, _with_sampling(path, {"json_schema": spec}, 8)))
        for kind, pool in (("regex", CATASTROPHIC_REGEXES), ("ebnf", HOSTILE_EBNF), ("choice", HOSTILE_CHOICES)):
            for i, spec in enumerate(pool):
                self.add(_json_case("grammar", f"{kind}#{i}", on(i), _with_sampling(on(i), {kind: spec}, 8)))
        for i, tag in enumerate(HOSTILE_STRUCTURAL_TAGS):
            self.add(_json_case("grammar", f"structural_tag#{i}", "/generate",
                                _with_sampling("/generate", {"structural_tag": tag}, 8)))
        for i, rf in enumerate(HOSTILE_RESPONSE_FORMATS):
            path = GENERATE_ROUTES[1 + i % 2]
            self.add(_json_case("grammar", f"response_format#{i}", path, _with_sampling(path, {"response_format": rf}, 8)))
        for path in GENERATE_ROUTES:  # two constraints at once
            self.add(_json_case("grammar", "regex+ebnf", path, _with_sampling(path, {"regex": "a", "ebnf": 'root ::= "a"'})))
        self.add(_json_case("grammar", "response_format + regex", "/v1/completions",
                            _with_sampling("/v1/completions", {"regex": "a", "response_format": {"type": "json_object"}})))

    def surrogates(self) -> None:
        """A lone surrogate (valid JSON: "\\ud800") in every string field, also streaming."""
        bad = "Hi \ud800 there"
        for path in GENERATE_ROUTES:
            fields: dict[str, Any] = {"stop": [bad], "regex": bad, "ebnf": f'root ::= "{bad}"', "choice": [bad],
                                      "logit_bias": {bad: 1}}
            if path != "/v1/chat/completions":
                fields["json_schema"] = {"enum": [bad]}
            for field, value in fields.items():
                for stream in (False, True):
                    obj = {**_with_sampling(path, {field: value}), **({"stream": True} if stream else {})}
                    self.add(_json_case("surrogate", f"{field}{' stream' if stream else ''}", path, obj))
            obj = _with_sampling(path, {"custom_params": {"token_ids": [1], "note": bad}})
            obj["custom_logit_processor"] = DISALLOW
            self.add(_json_case("surrogate", "custom_params", path, obj))
            self.add(_json_case("surrogate", "unknown key", path, {**_base(path), bad: 1}))
            if path != "/generate":
                for field in ("model", "user"):
                    for stream in (False, True):
                        self.add(_json_case("surrogate", f"{field}{' stream' if stream else ''}", path,
                                            {**_base(path), field: bad, **({"stream": True} if stream else {})}))
        for stream in (False, True):
            sfx = " stream" if stream else ""
            st = {"stream": True} if stream else {}
            self.add(_json_case("surrogate", "text" + sfx, "/generate", {**_base("/generate"), "text": bad, **st}))
            self.add(_json_case("surrogate", "rid" + sfx, "/generate",
                                {**_base("/generate"), "rid": bad + self.uid(), **st}))
            self.add(_json_case("surrogate", "prompt" + sfx, "/v1/completions",
                                {**_base("/v1/completions"), "prompt": bad, **st}))
            self.add(_json_case("surrogate", "prompt list" + sfx, "/v1/completions",
                                {**_base("/v1/completions"), "prompt": [bad], **st}))
            self.add(_json_case("surrogate", "message content" + sfx, "/v1/chat/completions",
                                {**_base("/v1/chat/completions"), "messages": [{"role": "user", "content": bad}], **st}))
        self.add(_json_case("surrogate", "structural_tag", "/generate", _with_sampling("/generate", {
            "structural_tag": {"structures": [{"begin": bad, "schema": {}, "end": "x"}], "triggers": [bad]}})))
        self.add(_json_case("surrogate", "message name", "/v1/chat/completions",
                            {**_base("/v1/chat/completions"), "messages": [{"role": "user", "content": "x", "name": bad}]}))
        self.add(_json_case("surrogate", "custom_logit_processor", "/generate",
                            {**_base("/generate"), "custom_logit_processor": bad}))
        self.add(_json_case("surrogate", "abort rid", "/abort_request", {"rid": bad}))

    def streams(self) -> None:
        """Requests that fail after validation (grammar compile, scheduler), streaming:
        the error must come as an SSE error event, then [DONE]."""
        for path in GENERATE_ROUTES:
            for name, fields in (("invalid regex", {"regex": "["}), ("empty-language ebnf", {"ebnf": "root ::= root"}),
                                 ("choice", {"choice": ["yes", "no"]}), ("top_k 2**70", {"top_k": 2**70}),
                                 ("top_k 2**64-1", {"top_k": 2**64 - 1}), ("stop abuse", {"stop": ["a"] * 1000}),
                                 ("seed 2**63-1", {"seed": 2**63 - 1}), ("ban every token", {
                                     "logit_bias": {str(i): -100 for i in range(VOCAB)}})):
                obj = {**_with_sampling(path, fields, 8), "stream": True}
                if path != "/generate":
                    obj["stream_options"] = {"include_usage": True}
                self.add(_json_case("stream", name, path, obj))

    def logit_bias_and_stops(self) -> None:
        """Each value through the native API and through one OpenAI API (they validate
        differently: pydantic first), the OpenAI one alternating."""
        for i, b in enumerate(LOGIT_BIASES):
            for path in _native_and_openai(i):
                self.add(_json_case("logit_bias", f"logit_bias#{i}", path, _with_sampling(path, {"logit_bias": b})))
        for i, s in enumerate(STOP_VALUES):
            for path in _native_and_openai(i):
                self.add(_json_case("stop", f"stop#{i}", path, _with_sampling(path, {"stop": s})))
        for i, s in enumerate(STOP_TOKEN_IDS):
            for path in _native_and_openai(i):
                self.add(_json_case("stop", f"stop_token_ids#{i}", path, _with_sampling(path, {"stop_token_ids": s})))

    def custom_processors(self) -> None:
        for path in ("/generate", "/v1/completions"):
            for i, p in enumerate(CUSTOM_PROCESSORS):
                obj = _base(path)
                obj["custom_logit_processor"] = p
                self.add(_json_case("custom_processor", f"custom_logit_processor#{i}", path, obj))
            for i, p in enumerate(CUSTOM_PARAMS):
                obj = _with_sampling(path, {"custom_params": p})
                obj["custom_logit_processor"] = DISALLOW
                self.add(_json_case("custom_processor", f"custom_params#{i}", path, obj))
        obj = _with_sampling("/generate", {"custom_logit_processor": DISALLOW.replace(" ", "")})
        obj["custom_logit_processor"] = DISALLOW
        self.add(_json_case("custom_processor", "processor twice, different text", "/generate", obj))

    def messages_and_prompts(self) -> None:
        for i, m in enumerate(MESSAGES):
            self.add(_json_case("messages", f"messages#{i}", "/v1/chat/completions",
                                {**_base("/v1/chat/completions"), "messages": m}))
        for i, kw in enumerate(CHAT_TEMPLATE_KWARGS):
            self.add(_json_case("messages", f"chat_template_kwargs#{i}", "/v1/chat/completions",
                                {**_base("/v1/chat/completions"), "chat_template_kwargs": kw}))
        for i, p in enumerate(PROMPTS):
            self.add(_json_case("prompt", f"prompt#{i}", "/v1/completions", {**_base("/v1/completions"), "prompt": p}))
        for i, ids in enumerate(INPUT_IDS):
            obj = _base("/generate")
            del obj["text"]
            obj["input_ids"] = ids
            self.add(_json_case("prompt", f"input_ids#{i}", "/generate", obj))
        obj = _base("/generate")
        obj["input_ids"] = [1, 2]
        self.add(_json_case("prompt", "text and input_ids", "/generate", obj))
        obj = _base("/generate")
        del obj["text"]
        self.add(_json_case("prompt", "no prompt", "/generate", obj))
        for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
            obj = _base(path)
            del obj[field]
            self.add(_json_case("prompt", f"no {field}", path, obj))

    def giant(self) -> None:
        """A few multi-megabyte bodies (rejected before tokenization) and a long prompt
        that is tokenized and fits."""
        mb = 1 << 20
        self.add(_json_case("giant", "2 MB text", "/generate", {**_base("/generate"), "text": "word " * (2 * mb // 5)}))
        self.add(_json_case("giant", "3 MB prompt", "/v1/completions", {**_base("/v1/completions"),
                                                                           "prompt": "x" * (3 * mb)}))
        self.add(_json_case("giant", "1 MB chat content x2", "/v1/chat/completions", {
            **_base("/v1/chat/completions"),
            "messages": [{"role": "user", "content": "y" * mb}, {"role": "user", "content": "z" * mb}]}))
        self.add(_json_case("giant", "5 MB unknown field", "/generate", {**_base("/generate"), "pad": "p" * (5 * mb)}))
        self.add(_json_case("giant", "1 MB stop string (stream)", "/v1/completions",
                            {**_base("/v1/completions"), "stop": ["s" * mb], "stream": True}))
        self.add(_json_case("giant", "1.5 MB chat content list", "/v1/chat/completions", {
            **_base("/v1/chat/completions"),
            "messages": [{"role": "user", "content": [{"type": "text", "text": "t" * 1000}] * 1500}]}))
        self.add(_json_case("giant", "200k input_ids", "/generate",
                            {"input_ids": [1] * 200_000, "sampling_params": {"max_new_tokens": 1}}))
        self.add(_json_case("giant", "1500-token prompt", "/generate",
                            {"text": "one two " * 750, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))
        self.add(_json_case("giant", "60k-char text tokenized off-loop", "/v1/completions",
                            {**_base("/v1/completions"), "prompt": "lorem ipsum " * 5000}))

    def broken_json(self) -> None:
        valid = dumps(_base("/generate"))
        for path in POST_ROUTES:
            base = dumps(_base(path))
            bodies = {
                "empty": b"", "space": b"   ", "null": b"null", "list": b"[]", "string": b'"x"', "number": b"1",
                "true": b"true", "nan": b"NaN", "truncated-half": base[: len(base) // 2], "truncated-1": base[:-1],
                "trailing garbage": base + b"garbage", "two objects": base + base, "single quotes": base.replace(b'"', b"'"),
                "comment": b"/* c */" + base, "trailing comma": base[:-1] + b",}", "bom": b"\xef\xbb\xbf" + base,
                "utf-16": base.decode().encode("utf-16"), "utf-32": base.decode().encode("utf-32"),
                "latin-1 bytes": base[:-1] + b', "x": "\xe9\xff"}', "raw surrogate utf-8": base[:-1] + b', "x": "\xed\xa0\x80"}',
                "nul byte": base[:-1] + b', "x": "\x00"}', "control char": base[:-1] + b', "x": "\x01\x1f"}',
                "bad escape": base[:-1] + b', "x": "\\q"}', "truncated escape": base[:-1] + b', "x": "\\u12"}',
                "unterminated string": b'{"text": "abc', "only brace": b"{", "only bracket": b"[",
                "deep array 20000": b"[" * 20000 + b"]" * 20000, "deep object 20000": b'{"a":' * 20000 + b"1" + b"}" * 20000,
                "unclosed deep 20000": b"[" * 20000, "deep 129": b"[" * 129 + b"]" * 129, "deep 128": b"[" * 128 + b"]" * 128,
                "deep in unknown field": base[:-1] + b', "zz": ' + b"[" * 20000 + b"]" * 20000 + b"}",
                "deep in string only": base[:-1] + b', "zz": "' + b"[" * 20000 + b'"}',
                "duplicate keys": base[:-1] + b", " + base[1:], "5000-digit int": b'{"rid": ' + b"1" * 5000 + b"}",
                "huge exponent": b'{"rid": 1e99999999999}', "binary": bytes(range(256)), "xml": b"<?xml version='1.0'?><a/>",
                "form": b"text=Hello&max_new_tokens=4", "gzip magic": b"\x1f\x8b\x08\x00" + base,
            }
            for name, body in bodies.items():
                self.add(Case("broken_json", name, "POST", path, body, dict(JSON_CT)))
        # content types and transfer encodings do not change how the body is read
        for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                   "application/json; charset=utf-16", "", "\x7f"):
            self.add(Case("headers", f"content-type {ct!r}", "POST", "/generate", valid, {"Content-Type": ct.encode()},
                          _base("/generate")))
        self.add(Case("headers", "no content-type", "POST", "/generate", valid, {}, _base("/generate")))
        self.add(Case("headers", "content-encoding gzip (not gzipped)", "POST", "/generate", valid,
                      {**JSON_CT, "Content-Encoding": "gzip"}, _base("/generate")))
        self.add(Case("headers", "bogus authorization", "POST", "/generate", valid,
                      {**JSON_CT, "Authorization": b"Bearer \xff\xfe"}, _base("/generate")))
        self.add(Case("headers", "chunked body", "POST", "/v1/completions", dumps(_base("/v1/completions")),
                      {**JSON_CT, "X-Chunked": "1"}, _base("/v1/completions")))
        self.add(Case("headers", "huge header", "POST", "/generate", valid, {**JSON_CT, "X-Pad": "h" * 8000},
                      _base("/generate")))

    def deep(self) -> None:
        """Deep nesting inside fields, and depth just under the limit."""
        for path in GENERATE_ROUTES:
            for where in ("stop", "logit_bias", "stop_token_ids", "custom_params", "json_schema", "choice"):
                for depth in (20000, 127):
                    self.add(_json_case("deep", f"{where} depth {depth}", path,
                                        _with_sampling(path, {where: _deep(depth)})))
            for where in ("json_schema", "structural_tag"):  # JSON given as text: depth-checked too
                for text in ("[" * 20000 + "]" * 20000, "[" * 5000, '{"a":' * 5000):
                    self.add(_json_case("deep", f"{where} as a deep string {text[:2]!r}", path,
                                        _with_sampling(path, {where: text})))
            self.add(_json_case("deep", "unknown field deep", path, {**_base(path), "zz": _deep(20000)}))
            self.add(_json_case("deep", "unknown field deep objects", path, {**_base(path), "zz": _deep_obj(20000)}))
        self.add(_json_case("deep", "sampling_params deep", "/generate", {"text": "Hi", "sampling_params": _deep_obj(20000)}))
        self.add(_json_case("deep", "abort deep", "/abort_request", {"rid": _deep(20000)}))
        self.add(_json_case("deep", "response_format deep", "/v1/chat/completions",
                            {**_base("/v1/chat/completions"), "response_format": _deep_obj(20000)}))
        self.add(_json_case("deep", "messages deep", "/v1/chat/completions",
                            {**_base("/v1/chat/completions"), "messages": _deep(20000)}))
        self.add(_json_case("deep", "prompt deep", "/v1/completions", {**_base("/v1/completions"), "prompt": _deep(20000)}))
        chat = "/v1/chat/completions"
        for text in ("[" * 5000, "[" * 2000 + "]" * 2000, '{"a":' * 3000 + "1" + "}" * 3000):
            call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": text}}
            history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
            self.add(_json_case("deep", f"tool_calls arguments deep string {text[:2]!r}", chat,
                                {**_base(chat), "messages": history, "tools": [GOOD_TOOL]}))
            self.add(_json_case("deep", f"custom_logit_processor deep string {text[:2]!r}", "/generate",
                                {**_base("/generate"), "custom_logit_processor": text}))
            self.add(_json_case("deep", f"structured_outputs json deep string {text[:2]!r}", chat,
                                {**_base(chat), "structured_outputs": {"json": text}}))

    def edges(self) -> None:
        """Boundary values of every sampling parameter, and n / max tokens."""
        singles = {
            "temperature": [0, 1e-300, 1e300, -0.0, -1e-300], "top_p": [0, 1, 1.0000001, 1e-300, -1],
            "top_k": [0, -1, -2, 1, VOCAB, VOCAB + 1, 10**6, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70],
            "min_p": [0, 1, 1.0000001, -1e-300], "repetition_penalty": [0, 1e-300, 2, 2.0000001],
            "frequency_penalty": [-2, 2, 2.0000001], "presence_penalty": [-2, 2, -2.0000001],
            "seed": [-1, 0, 2**63 - 1, 2**63, 2**64, 2**70, 1.0], "n": [0, 1, 2, -1, 2**70, 1.0],
        }
        n = 0
        for field, values in singles.items():
            for v in values:
                n += 1
                for path in _native_and_openai(n):
                    self.add(_json_case("edge", f"{field}={v!r}", path, _with_sampling(path, {field: v})))
        for path in GENERATE_ROUTES:
            mt = "max_new_tokens" if path == "/generate" else "max_tokens"
            mn = "min_new_tokens" if path == "/generate" else "min_tokens"
            for v in MAXTOK_VALUES:
                obj = _with_sampling(path, {mt: v})
                self.add(_json_case("edge", f"{mt}={v!r}", path, obj))
            self.add(_json_case("edge", f"{mn} > {mt}", path, _with_sampling(path, {mn: 5, mt: 4})))
            self.add(_json_case("edge", f"{mn} = {mt} with stop ids", path,
                                _with_sampling(path, {mn: 4, mt: 4, "stop_token_ids": [0, 1, 2]})))
            self.add(_json_case("edge", "ignore_eos", path, _with_sampling(path, {"ignore_eos": True})))
        self.add(_json_case("edge", "max_completion_tokens huge", "/v1/chat/completions",
                            {**_base("/v1/chat/completions"), "max_completion_tokens": 2**70}))
        self.add(_json_case("edge", "max_completion_tokens=2 over max_tokens", "/v1/chat/completions",
                            {**_base("/v1/chat/completions"), "max_tokens": BIG, "max_completion_tokens": 2}))
        for name, extra in (("logprobs", {"logprobs": True}), ("top_logprobs", {"top_logprobs": 5}),
                            ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
                            ("tool_choice", {"tool_choice": "required"}), ("audio", {"audio": {}}),
                            ("modalities", {"modalities": ["audio"]}), ("prediction", {"prediction": {}}),
                            ("stream_options", {"stream": True, "stream_options": {"include_usage": True}}),
                            ("stream_options bad", {"stream_options": {"include_usage": "x"}}),
                            ("stream_options unknown", {"stream_options": {"bogus": 1}})):
            self.add(_json_case("edge", name, "/v1/chat/completions", {**_base("/v1/chat/completions"), **extra}))
        for name, extra in (("echo", {"echo": True}), ("suffix", {"suffix": "x"}), ("best_of", {"best_of": 2}),
                            ("logprobs", {"logprobs": 1}), ("batched prompts", {"prompt": ["a", "b"]})):
            self.add(_json_case("edge", name, "/v1/completions", {**_base("/v1/completions"), **extra}))
        for name, extra in (("rid list", {"rid": ["a", "b"]}), ("text list", {"text": ["a", "b"]}),
                            ("require_reasoning", {"require_reasoning": True})):
            self.add(_json_case("edge", name, "/generate", {**_base("/generate"), **extra}))

    def api_fields(self) -> None:
        """The newer API fields: tools / tool_choice / parallel_tool_calls, n, chat logprobs /
        top_logprobs, completions logprobs / echo, native return_logprob / top_logprobs_num /
        logprob_start_len / return_text_in_logprobs, vLLM's structured_outputs / guided_* /
        guided_decoding_backend, response_format json_schema with strict, stream_options."""
        chat, comp, gen = "/v1/chat/completions", "/v1/completions", "/generate"
        named = {"type": "function", "function": {"name": "get_weather"}}
        for i, tools in enumerate(TOOLS):
            choice = ("auto", "required", named, None)[i % 4]
            obj = {**_base(chat, 3), "tools": tools, **({} if choice is None else {"tool_choice": choice})}
            if i % 3 == 0:
                obj["parallel_tool_calls"] = bool(i % 2)
            self.add(_json_case("api_tools", f"tools#{i} tool_choice={_brief(choice)}", chat, obj))
        for i, tc in enumerate(TOOL_CHOICES):
            self.add(_json_case("api_tools", f"tool_choice#{i}", chat,
                                {**_base(chat, 3), "tools": [GOOD_TOOL], "tool_choice": tc}))
            if i % 2 == 0:
                self.add(_json_case("api_tools", f"tool_choice#{i} without tools", chat,
                                    {**_base(chat, 3), "tool_choice": tc}))
        for i, ptc in enumerate(WRONG_TYPES[::2] + [NAN]):
            self.add(_json_case("api_tools", f"parallel_tool_calls={_brief(ptc)}", chat, {
                **_base(chat, 3), "tools": [GOOD_TOOL], "tool_choice": "required", "parallel_tool_calls": ptc}))
        for name, extra in (("required + regex", {"regex": "a+"}), ("required + guided_json", {"guided_json": {}}),
                            ("required + response_format", {"response_format": {"type": "json_object"}}),
                            ("required + structured_outputs", {"structured_outputs": {"choice": ["a"]}}),
                            ("named + n=2", {"n": 2}), ("required + logprobs", {"logprobs": True, "top_logprobs": 2}),
                            ("required + stream", {"stream": True, "stream_options": {"include_usage": True}}),
                            ("required + stream + n=2", {"stream": True, "n": 2}),
                            ("auto + stream", {"stream": True, "tool_choice": "auto"}),
                            ("none", {"tool_choice": "none"}), ("required + max_tokens=1", {"max_tokens": 1}),
                            ("required + max_tokens=0", {"max_tokens": 0})):
            obj = {**_base(chat, 3), "tools": [GOOD_TOOL], "tool_choice": "required", **extra}
            self.add(_json_case("api_tools", name, chat, obj))
        self.add(_json_case("api_tools", "assistant tool_calls history with garbage", chat, {**_base(chat, 3), "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": 1, "type": "function", "function": {"name": "f", "arguments": "{"}}]},
            {"role": "tool", "tool_call_id": None, "content": {"a": 1}}], "tools": [GOOD_TOOL]}))
        # n, with and without logprobs and streams, on all three APIs
        n_values = [0, -1, 1, 2, 3, 8, 129, 10**6, 2**31, 2**63, 2**70, 1.5, 2.0, "2", None, True, NAN]
        for i, n in enumerate(n_values):
            for path in GENERATE_ROUTES:
                obj = _with_sampling(path, {"n": n}, 2)
                if i % 3 == 1:
                    obj["stream"] = True
                if i % 4 == 2:
                    obj.update({"/generate": {"return_logprob": True, "top_logprobs_num": 2},
                                "/v1/completions": {"logprobs": 2}, chat: {"logprobs": True, "top_logprobs": 2}}[path])
                self.add(_json_case("api_n", f"n={_brief(n)}", path, obj))
        # chat logprobs / top_logprobs
        for i, (lp, top) in enumerate([(True, 0), (True, 20), (True, 21), (True, -1), (False, 5), (None, 5),
                                       (True, 2**70), (True, "5"), (True, 1.5), ("yes", None), (1, None),
                                       (True, NAN), (True, None), ([True], 1), (True, {"a": 1}), (True, 2**63)]):
            obj = {**_base(chat, 2), "logprobs": lp, **({} if top is None else {"top_logprobs": top})}
            if i % 3 == 0:
                obj["stream"] = True
            if i % 5 == 1:
                obj["n"] = 2
            self.add(_json_case("api_logprobs", f"chat logprobs={_brief(lp)} top_logprobs={_brief(top)}", chat, obj))
        # completions logprobs / echo
        for i, lp in enumerate([-1, 0, 1, 5, 20, 21, 2**70, True, "1", 1.5, None, [], NAN, {"a": 1}]):
            obj = {**_base(comp, 2), "logprobs": lp, "echo": bool(i % 2)}
            if i % 3 == 0:
                obj["stream"] = True
            self.add(_json_case("api_logprobs", f"completions logprobs={_brief(lp)} echo={bool(i % 2)}", comp, obj))
        for i, echo in enumerate(WRONG_TYPES[::2] + [NAN]):
            self.add(_json_case("api_logprobs", f"echo={_brief(echo)}", comp, {**_base(comp, 2), "echo": echo}))
        for name, extra in (("echo + max_tokens=0", {"echo": True, "max_tokens": 0}),
                            ("echo + logprobs + max_tokens=0", {"echo": True, "logprobs": 3, "max_tokens": 0}),
                            ("echo + token-id prompt + logprobs", {"echo": True, "logprobs": 1, "prompt": [1, 2, 3]}),
                            ("echo + batched prompts + n=2", {"echo": True, "prompt": ["a", "b"], "n": 2, "logprobs": 1}),
                            ("echo + stream + logprobs", {"echo": True, "stream": True, "logprobs": 2}),
                            ("echo + 1-token prompt + logprobs", {"echo": True, "prompt": [1], "logprobs": 5}),
                            ("echo + regex", {"echo": True, "regex": "[0-9]+", "logprobs": 1})):
            self.add(_json_case("api_logprobs", name, comp, {**_base(comp, 2), **extra}))
        # native logprob fields
        for i, v in enumerate(WRONG_TYPES[::2] + [NAN]):
            self.add(_json_case("api_logprobs", f"return_logprob={_brief(v)}", gen, {**_base(gen, 2), "return_logprob": v}))
            self.add(_json_case("api_logprobs", f"return_text_in_logprobs={_brief(v)}", gen,
                                {**_base(gen, 2), "return_logprob": True, "return_text_in_logprobs": v}))
        for i, v in enumerate([-1, 0, 1, 20, 21, 10**6, 2**63, 2**70, 1.5, 2.0, "3", None, True, NAN, [], {}]):
            self.add(_json_case("api_logprobs", f"top_logprobs_num={_brief(v)}", gen,
                                {**_base(gen, 2), "return_logprob": bool(i % 5), "top_logprobs_num": v,
                                 **({"stream": True} if i % 4 == 0 else {})}))
        for i, v in enumerate(LOGPROB_START_LENS + [None, [], True]):
            self.add(_json_case("api_logprobs", f"logprob_start_len={_brief(v)}", gen,
                                {**_base(gen, 2), "return_logprob": i % 5 != 4, "logprob_start_len": v,
                                 "top_logprobs_num": 1, **({"stream": True} if i % 3 == 0 else {})}))
        for name, extra in (("no return_logprob but top_logprobs_num", {"top_logprobs_num": 3}),
                            ("no return_logprob but logprob_start_len", {"logprob_start_len": 0}),
                            ("no return_logprob but text", {"return_text_in_logprobs": True}),
                            ("logprobs + n=3 + stream", {"return_logprob": True, "top_logprobs_num": 2,
                                                         "logprob_start_len": 0, "return_text_in_logprobs": True,
                                                         "stream": True, "sampling_params": {"max_new_tokens": 3, "n": 3}}),
                            ("logprobs + input_ids", {"text": None, "input_ids": [1, 2, 3], "return_logprob": True,
                                                      "logprob_start_len": 2, "top_logprobs_num": 20}),
                            ("logprobs + max_new_tokens=0", {"return_logprob": True, "logprob_start_len": 0,
                                                             "sampling_params": {"max_new_tokens": 0}}),
                            ("logprobs + regex", {"return_logprob": True, "top_logprobs_num": 5,
                                                  "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}}),
                            ("logprobs + ban every token", {"return_logprob": True, "top_logprobs_num": 5, "sampling_params": {
                                "max_new_tokens": 2, "logit_bias": {str(i): -100 for i in range(0, VOCAB, 3)}}})):
            obj = {**_base(gen, 2), **extra}
            if obj.get("text", "") is None:
                del obj["text"]
            self.add(_json_case("api_logprobs", name, gen, obj))
        # vLLM's dialect
        for i, so in enumerate(STRUCTURED_OUTPUTS):
            path = (comp, chat)[i % 2]
            self.add(_json_case("api_vllm", f"structured_outputs#{i}", path, _with_sampling(path, {"structured_outputs": so}, 3)))
        for field, pool in (("guided_json", HOSTILE_SCHEMAS), ("guided_regex", CATASTROPHIC_REGEXES),
                            ("guided_choice", HOSTILE_CHOICES), ("guided_grammar", HOSTILE_EBNF)):
            # The dialect's mapping is what is new here: every third spec, but none of the
            # big ones (their compile cost is the grammar cases' business).
            light = [spec for spec in pool[::3] if len(dumps(spec)) < 2000]
            for i, spec in enumerate(light + WRONG_TYPES[::4]):
                path = (comp, chat)[i % 2]
                self.add(_json_case("api_vllm", f"{field}#{i}", path, _with_sampling(path, {field: spec}, 3)))
        for i, backend in enumerate(["xgrammar", "outlines", "llguidance", "auto", "bogus", "", 1, None, _deep(20000)]):
            path = (comp, chat)[i % 2]
            self.add(_json_case("api_vllm", f"guided_decoding_backend={_brief(backend)}", path,
                                _with_sampling(path, {"guided_decoding_backend": backend, "guided_regex": "[0-9]"}, 3)))
        for i, (name, fields) in enumerate((
                ("guided_json + response_format", {"guided_json": {}, "response_format": {"type": "json_object"}}),
                ("structured_outputs + regex", {"structured_outputs": {"regex": "a"}, "regex": "a"}),
                ("guided_regex + guided_choice", {"guided_regex": "a", "guided_choice": ["a"]}),
                ("guided_json + structured_outputs.json", {"guided_json": {}, "structured_outputs": {"json": {}}}),
                ("guided_whitespace_pattern + guided_json", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"}),
                ("guided_whitespace_pattern catastrophic", {"guided_json": {}, "guided_whitespace_pattern": "(a+)+$"}),
                ("guided_whitespace_pattern + regex", {"guided_regex": "a", "guided_whitespace_pattern": " "}),
                ("guided_whitespace_pattern alone", {"guided_whitespace_pattern": " "}),
                ("guided_json as JSON text", {"guided_json": '{"type": "integer"}'}),
                ("guided_json deep text", {"guided_json": "[" * 20000 + "]" * 20000}),
                ("guided_choice + stream", {"guided_choice": ["yes", "no"], "stream": True}),
                ("structured_outputs json_object + n=2", {"structured_outputs": {"json_object": True}, "n": 2}))):
            for path in (comp, chat):
                self.add(_json_case("api_vllm", name, path, _with_sampling(path, fields, 3)))
        # response_format json_schema with strict
        for i, rf in enumerate(RF_STRICT):
            path = (chat, comp)[i % 2]
            self.add(_json_case("api_response_format", f"strict#{i}", path, _with_sampling(path, {"response_format": rf}, 3)))
        # stream_options
        for i, so in enumerate(STREAM_OPTIONS):
            for path in (chat, comp):
                for stream in (True, False) if i % 3 == 0 else (True,):
                    self.add(_json_case("api_stream_options", f"stream_options#{i} stream={stream}", path,
                                        {**_base(path, 2), "stream": stream, "stream_options": so}))
        self.add(_json_case("api_stream_options", "include_usage + n=2 + logprobs", chat, {
            **_base(chat, 2), "stream": True, "n": 2, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}))

    def unknown_fields(self) -> None:
        for path in POST_ROUTES:
            for k in UNKNOWN_KEYS:
                obj = _base(path)
                if k in obj:
                    continue
                obj[k] = 1
                self.add(_json_case("unknown_field", f"top-level {k[:20]!r}", path, obj))
        for k in UNKNOWN_KEYS[:8]:
            obj = _base("/generate")
            obj["sampling_params"][k] = 1
            self.add(_json_case("unknown_field", f"sampling_params {k[:20]!r}", "/generate", obj))

    def abort_bodies(self) -> None:
        for i, body in enumerate([{}, {"rid": None}, {"rid": 5}, {"rid": ""}, {"rid": "\ud800"}, {"rid": "x" * 100_000},
                                  {"abort_all": False}, {"abort_all": "true"}, {"abort_all": 1}, {"rid": ["a"]},
                                  {"rid": {"a": 1}}, [], "x", {"rid": "nope", "extra": 1}]):
            self.add(_json_case("abort", f"abort body#{i}", "/abort_request", body))

    def routes(self) -> None:
        """Wrong methods on every route and unknown paths."""
        for path in POST_ROUTES:
            for m in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"):
                self.add(Case("route", f"{m} on POST route", m, path, route_case=True))
        for path in GET_ROUTES:
            self.add(Case("get", "GET", "GET", path))
            self.add(Case("get", "GET with a body", "GET", path, b'{"x": 1}', dict(JSON_CT)))
            self.add(Case("get", "GET with query", "GET", path + "?x=%ff%00&y=" + "q" * 2000))
            for m in ("POST", "PUT", "DELETE", "PATCH"):
                self.add(Case("route", f"{m} on GET route", m, path, b"{}", dict(JSON_CT), route_case=True))
            self.add(Case("route", "HEAD on GET route", "HEAD", path, route_case=True))
        for path in ("/", "/v1", "/v1/", "/v2/completions", "/generate/", "/v1/chat/completions/", "/GENERATE",
                     "/v1/engines", "/v1/embeddings", "/v1/models/smollm2", "/admin", "/%00", "/%ff%fe",
                     "/..%2f..%2fetc%2fpasswd", "//generate", "/generate;x", "/" + "a" * 4000, "/v1/chat",
                     "/abort_request/x", "/health/..", "/get_server_info%20"):
            for m in ("GET", "POST"):
                self.add(Case("route", "unknown path", m, path, dumps(_base("/generate")) if m == "POST" else None,
                              dict(JSON_CT) if m == "POST" else {}, route_case=True))
        self.add(Case("route", "custom method", "FOO", "/generate", route_case=True))

    # -- random mutations -------------------------------------------------------------
    def random_cases(self, n: int) -> None:
        rng = self.rng
        endpoints = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
        weights = [4, 3, 4, 1]
        for i in range(n):
            path = rng.choices(endpoints, weights)[0]
            obj = _base(path)
            if path == "/abort_request":
                obj = {"rid": rng.choice(["x", "", "\ud800", 5, None, [], "a" * 5000]), **(
                    {rng.choice(UNKNOWN_KEYS): rng.choice(WRONG_TYPES)} if rng.random() < 0.3 else {})}
                muts = ["abort"]
            else:
                muts = self._mutate(path, obj, rng.randint(1, 3))
                if path == "/generate" and isinstance(obj.get("rid"), str):
                    obj["rid"] += f"-{self.uid()}"  # unique: concurrent cases never share a rid
            body, category = dumps(obj), "random"
            if rng.random() < 0.12:  # break the JSON text itself
                body, how = self._corrupt(body)
                muts.append(how)
                category = "random_broken"
            self.add(Case(category, f"#{i} {', '.join(muts)}", "POST", path, body, dict(JSON_CT), obj))

    def _mutate(self, path: str, obj: dict, k: int) -> list[str]:
        rng = self.rng
        done = []
        for _ in range(k):
            if path == "/generate":
                if rng.random() < 0.7:
                    field, kind = rng.choice(list(SAMPLING_KINDS.items()))
                    target = obj["sampling_params"] if isinstance(obj.get("sampling_params"), dict) else obj
                else:
                    field, kind = rng.choice(list(GENERATE_TOP_KINDS.items()))
                    target = obj
            else:
                kinds = CHAT_KINDS if path == "/v1/chat/completions" else COMPLETION_KINDS
                field, kind = rng.choice(list(kinds.items()))
                target = obj
            r = rng.random()
            if r < 0.08:
                field, value = rng.choice(UNKNOWN_KEYS), rng.choice(WRONG_TYPES)
            elif r < 0.16 and kind in ("str", "text", "regex", "ebnf"):
                value = rng.choice(SURROGATES)
            elif r < 0.22 and kind in ("int", "float", "maxtok"):
                value = rng.choice(NUM_EDGES if kind != "maxtok" else MAXTOK_VALUES)
            else:
                value = rng.choice(_pool_for(kind))
            if field == "input_ids" and rng.random() < 0.5:
                obj.pop("text", None)
            if field == "sampling_params" and isinstance(value, dict):
                value = {**value, "max_new_tokens": 4}  # {} would mean 128 tokens
            if value is None and field in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
                value = -1  # null means "up to the context": not a short request (and MAXTOK_VALUES
                # holds no valid count above 4 either: _check_generation would notice one)
            target[field] = value
            done.append(f"{field}={_brief(value)}")
        if rng.random() < 0.15:
            obj["stream"] = True
            done.append("stream")
        return done

    def _corrupt(self, body: bytes) -> tuple[bytes, str]:
        rng = self.rng
        how = rng.choice(["truncate", "flip", "insert", "drop-quote", "append"])
        pos = rng.randrange(max(1, len(body)))
        if how == "truncate":
            return body[:pos], f"truncated at {pos}"
        if how == "flip":
            return body[:pos] + bytes([rng.randrange(256)]) + body[pos + 1:], f"byte {pos} flipped"
        if how == "insert":
            junk = rng.choice([b"\xff", b"\x00", b"}", b"]", b",", b'"', b"\\", b"\xed\xa0\x80", b"NaN"])
            return body[:pos] + junk + body[pos:], f"{junk!r} inserted at {pos}"
        if how == "drop-quote":
            i = body.find(b'"', pos)
            return (body[:i] + body[i + 1:], "a quote dropped") if i >= 0 else (body + b"{", "brace appended")
        return body + rng.choice([b"x", b"{", b"[1", b"\n\n\n", b"\x00"]), "garbage appended"

    # -- sequential scenarios -----------------------------------------------------------
    def scenarios(self) -> None:
        for path in GENERATE_ROUTES:
            self.add(Case("scenario", "stream cut off by the client", "POST", path, obj={"scenario": "cut"},
                          runner=lambda base, p=path: _scenario_cut_stream(base, p)))
        self.add(Case("scenario", "client disconnects from a non-streaming request", "POST", "/v1/chat/completions",
                      obj={"scenario": "disconnect"}, runner=_scenario_disconnect))
        self.add(Case("scenario", "abort by rid: the aborted non-streaming request's answer", "POST", "/abort_request",
                      obj={"scenario": "abort-rid"}, runner=_scenario_abort_rid))
        self.add(Case("scenario", "abort_all: the aborted streams' answers", "POST", "/abort_request",
                      obj={"scenario": "abort-all"}, runner=_scenario_abort_all))
        self.add(Case("scenario", "duplicate rid while the first is running (non-streaming)", "POST", "/generate",
                      obj={"scenario": "dup-rid", "stream": False}, runner=lambda b: _scenario_dup_rid(b, False)))
        self.add(Case("scenario", "duplicate rid while the first is running (streaming)", "POST", "/generate",
                      obj={"scenario": "dup-rid", "stream": True}, runner=lambda b: _scenario_dup_rid(b, True)))

    def loop_blockers(self) -> None:
        """Small requests that make the frontend do a lot of work, and large ones the README
        promises to handle off the event loop; each is sent alone while /health is timed."""
        chat = _base("/v1/chat/completions")
        blockers = [
            ("chat_template output amplification (150-byte request, 3 MB prompt)", "/v1/chat/completions",
             {**chat, "chat_template_kwargs": {"chat_template": "{{ messages[0].content * 1500000 }}"}}),
            ("chat_template CPU burn (Jinja loops, 64M iterations)", "/v1/chat/completions",
             {**chat, "chat_template_kwargs": {"chat_template": "{% for i in range(400) %}{% for j in range(400) %}"
                                                               "{% for k in range(400) %}{% endfor %}{% endfor %}"
                                                               "{% endfor %}x"}}),
            ("3 MB prompt", "/v1/completions", {**_base("/v1/completions"), "prompt": "x" * 3_000_000}),
            ("240 KB prompt, tokenized", "/v1/completions", {**_base("/v1/completions"), "prompt": "lorem ipsum " * 20000}),
            ("700 KB chat message", "/v1/chat/completions",
             {**chat, "messages": [{"role": "user", "content": "y" * 700_000}]}),
            ("100k logit_bias entries", "/generate",
             _with_sampling("/generate", {"logit_bias": {str(i): 1 for i in range(100_000)}})),
            ("10k stop strings", "/v1/completions", _with_sampling("/v1/completions", {"stop": [f"s{i}" for i in range(10_000)]})),
            ("1000-message chat", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}] * 1000}),
        ]
        for name, path, obj in blockers:
            case = Case("loop_blocker", name, "POST", path, dumps(obj), dict(JSON_CT), obj)
            case.runner = lambda base, c=case: _scenario_loop_blocker(base, dataclasses.replace(c, runner=None))
            self.add(case)

    def build(self) -> list[Case]:
        self.grammars()
        self.surrogates()
        self.streams()
        self.logit_bias_and_stops()
        self.custom_processors()
        self.messages_and_prompts()
        self.giant()
        self.broken_json()
        self.deep()
        self.edges()
        self.api_fields()
        self.unknown_fields()
        self.abort_bodies()
        self.routes()
        self.random_cases(N_RANDOM_CASES)
        self.scenarios()
        self.loop_blockers()
        return self.cases


def _safe(s: str) -> str:
    """Printable anywhere (lone surrogates escaped)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _native_and_openai(i: int) -> tuple[str, str]:
    return "/generate", ("/v1/completions", "/v1/chat/completions")[i % 2]


def _brief(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# ---- sending and checking -------------------------------------------------------------
@dataclasses.dataclass
class Result:
    case: Case
    status: Optional[int]
    content_type: str = ""
    body: bytes = b""
    error: str = ""  # transport error (timeout, broken stream, ...)
    elapsed: float = 0.0
    note: str = ""  # what the scenario checked


_local = threading.local()


def _client(base: str) -> httpx.Client:
    c = getattr(_local, "client", None)
    if c is None:
        # No keep-alive: a pooled connection the server times out (5 s) would race a reuse.
        c = _local.client = httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S,
                                         limits=httpx.Limits(max_keepalive_connections=0))
    return c


def _send(base: str, case: Case) -> Result:
    t0 = time.perf_counter()
    try:
        content: Any = case.body
        headers = dict(case.headers)
        if headers.pop("X-Chunked", None) and case.body is not None:
            data = case.body
            content = iter([data[i:i + 7] for i in range(0, len(data), 7)])  # Transfer-Encoding: chunked
        with _client(base).stream(case.method, case.path, content=content, headers=headers) as r:
            res = Result(case, r.status_code, r.headers.get("content-type", ""))
            chunks = []
            try:
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
            except httpx.HTTPError as e:  # the status line came, then the body broke off
                res.error = f"{type(e).__name__}: {e}"
            res.body, res.elapsed = b"".join(chunks), time.perf_counter() - t0
            return res
    except httpx.HTTPError as e:
        return Result(case, None, error=f"{type(e).__name__}: {e}", elapsed=time.perf_counter() - t0)
    except Exception as e:  # the test could not even send it: a bug of this test
        return Result(case, None, error=f"client-side {type(e).__name__}: {e}", elapsed=time.perf_counter() - t0)


GENERIC_MESSAGES = {"", "bad request", "internal server error", "error", "invalid request", "unknown error",
                    "not found", "method not allowed", "unprocessable entity", "none", "null", "exception",
                    "value error", "request aborted.", "generation failed."}
# Messages that leak Python internals instead of naming what is wrong with the request.
INTERNAL_LEAKS = re.compile(
    r"is not a valid HTTPStatus|codec can't encode|surrogates not allowed|TextEncodeInput must be|"
    r"got multiple values for|object has no attribute|unhashable type|Traceback|"
    r"takes \d+ positional argument|unexpected keyword argument|can't serialize ints|"
    r"invalid literal for int\(\)|list index out of range|KeyError|maximum recursion depth|"
    r"Exceeds the limit \(\d+ digits\)|set_int_max_str_digits")


def _specific(message: Any) -> Optional[str]:
    """None when ``message`` is specific, else why not."""
    if not isinstance(message, str) or message.strip().lower() in GENERIC_MESSAGES or len(message.strip()) < 8:
        return f"non-specific message {message!r}"
    m = INTERNAL_LEAKS.search(message)
    if m:
        return f"message leaks internals ({m.group(0)!r}) instead of naming the problem: {message[:200]!r}"
    return None


def _check_error_json(body: bytes) -> Optional[str]:
    try:
        data = json.loads(body)
    except ValueError:
        return f"error body is not JSON: {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return f"error body is not OpenAI's {{'error': {{'message': ...}}}}: {body[:200]!r}"
    return _specific(err.get("message"))


def _check_sse(body: bytes) -> Optional[str]:
    text = body.decode("utf-8", "replace")
    events = [e for e in text.split("\n\n") if e.strip()]
    if not events:
        return "200 stream with no events"
    for ev in events:
        if not ev.startswith("data: "):
            return f"SSE event without 'data: ': {ev[:200]!r}"
        payload = ev[len("data: "):]
        if payload == "[DONE]":
            continue
        try:
            data = json.loads(payload)
        except ValueError:
            return f"SSE event is not JSON: {payload[:200]!r}"
        if isinstance(data, dict) and "error" in data:
            err = data["error"]
            code = err.get("code") if isinstance(err, dict) else None
            if isinstance(code, int) and code >= 500:
                return f"stream carries a {code} error: {payload[:300]!r}"
            why = _specific(err.get("message") if isinstance(err, dict) else None)
            if why:
                return f"stream error event: {why}"
    if events[-1] != "data: [DONE]":
        return f"stream does not end with 'data: [DONE]' (last event: {events[-1][:200]!r})"
    return None


def check(res: Result) -> Optional[str]:
    """None if the response is acceptable, else what is wrong."""
    case = res.case
    if res.note.startswith("FAIL"):
        return res.note[5:]
    if res.note == "ok":  # a scenario that checked this response itself
        return None
    if res.status is None:
        return f"no response: {res.error}"
    if res.error:
        return (f"HTTP {res.status}, then the body broke off ({res.error}) after "
                f"{len(res.body)} bytes: ...{res.body[-200:]!r}")
    s = res.status
    if s >= 500:
        return f"HTTP {s}: {res.body[:300]!r}"
    if 300 <= s < 400:
        return None if case.route_case else f"unexpected redirect {s}"
    if 400 <= s < 500:
        if case.route_case and s in (404, 405):
            return None if res.body or case.method == "HEAD" else f"{s} with an empty body"
        return _check_error_json(res.body)
    if case.method == "HEAD" or s == 204:
        return None
    if "text/event-stream" in res.content_type:
        return _check_sse(res.body)
    if case.path.partition("?")[0] in ("/health", "/health_generate") and not res.body:
        return None
    try:
        data = json.loads(res.body)
    except ValueError:
        return f"{s} body is not JSON: {res.body[:200]!r}"
    if case.category != "scenario" and case.path in GENERATE_ROUTES and s == 200:
        return _check_generation(case.path, data)
    return None


MAX_FUZZ_TOKENS = 8  # no fuzz case asks for more (scenarios aside)


def _check_generation(path: str, data: Any) -> Optional[str]:
    """A 200 generation has the API's shape and stayed within the tokens the case allows."""
    try:
        if path == "/generate":  # n > 1: a list of samples, each within the token limit
            outs = data if isinstance(data, list) else [data]
            assert outs and all(isinstance(o["text"], str) for o in outs)
            n = max(o["meta_info"]["completion_tokens"] for o in outs)
        else:
            choice = data["choices"][0]
            if path == "/v1/completions":
                assert isinstance(choice["text"], str)
            else:  # a tool call may come without content
                msg = choice["message"]
                assert isinstance(msg["content"], str) or (msg["content"] is None and msg["tool_calls"])
            n = data["usage"]["completion_tokens"] // len(data["choices"])  # per choice
    except (KeyError, IndexError, TypeError, AssertionError):
        return f"200 body does not have the {path} response shape: {json.dumps(data)[:300]}"
    if not isinstance(n, int) or n > MAX_FUZZ_TOKENS:
        return f"generated {n} tokens, more than any fuzz case allows ({MAX_FUZZ_TOKENS})"
    return None


# ---- sequential scenarios ---------------------------------------------------------------
LONG = 48  # tokens: long enough to be aborted / cut off mid-way


def _long_body(path: str, stream: bool, rid: Optional[str] = None) -> dict:
    obj = _with_sampling(path, {"ignore_eos": True}, LONG)
    obj["stream"] = stream
    if rid is not None:
        obj["rid"] = rid
    return obj


def _scenario_cut_stream(base: str, path: str) -> list[Result]:
    case = Case("scenario", f"stream cut off by the client ({path})", "POST", path, dumps(_long_body(path, True)))
    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S) as c:
        with c.stream("POST", path, content=case.body, headers=JSON_CT) as r:
            status = r.status_code
            for _ in r.iter_bytes():
                break  # one chunk, then hang up
    note = "ok" if status == 200 else f"FAIL stream answered {status}"
    return [Result(case, status, "text/event-stream", b"", note=note)]


def _scenario_disconnect(base: str) -> list[Result]:
    case = Case("scenario", "client gives up on a non-streaming request", "POST", "/v1/chat/completions",
                dumps(_long_body("/v1/chat/completions", False)))
    try:
        r = httpx.post(base + case.path, content=case.body, headers=JSON_CT, timeout=httpx.Timeout(10, read=0.3))
        return [Result(case, r.status_code, r.headers.get("content-type", ""), r.content)]  # it was quick
    except httpx.ReadTimeout:
        return [Result(case, 200, note="ok")]  # gone; the in-flight check after the fuzz sees it aborted


def _wait_running(base: str, n: int, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(base + "/get_server_info", timeout=10).json()["num_inflight_requests"] >= n:
            return
        time.sleep(0.05)


def _scenario_abort_rid(base: str) -> list[Result]:
    rid = f"fuzz-abort-{random.Random(SEED).randrange(10**9)}"
    case = Case("scenario", "aborted by rid (non-streaming /generate)", "POST", "/generate",
                dumps(_long_body("/generate", False, rid)))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_send, base, case)
        _wait_running(base, 1)
        abort = Case("scenario", "abort_request by rid", "POST", "/abort_request", dumps({"rid": rid}), dict(JSON_CT))
        ra = _send(base, abort)
        return [ra, fut.result()]


def _scenario_abort_all(base: str) -> list[Result]:
    cases = [Case("scenario", f"aborted by abort_all ({p}, stream)", "POST", p, dumps(_long_body(p, True)), dict(JSON_CT))
             for p in GENERATE_ROUTES]
    cases.append(Case("scenario", "aborted by abort_all (/v1/completions, non-streaming)", "POST", "/v1/completions",
                      dumps(_long_body("/v1/completions", False)), dict(JSON_CT)))
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futs = [pool.submit(_send, base, c) for c in cases]
        _wait_running(base, len(cases))
        abort = Case("scenario", "abort_all", "POST", "/abort_request", dumps({"abort_all": True}), dict(JSON_CT))
        ra = _send(base, abort)
        return [ra] + [f.result() for f in futs]


def _scenario_dup_rid(base: str, stream: bool) -> list[Result]:
    rid = f"fuzz-dup-{'s' if stream else 'n'}"
    first = Case("scenario", "first request of a duplicated rid", "POST", "/generate",
                 dumps(_long_body("/generate", False, rid)), dict(JSON_CT))
    second = Case("scenario", f"second request, same rid ({'streaming' if stream else 'non-streaming'})", "POST",
                  "/generate", dumps({**_base("/generate"), "rid": rid, "stream": stream}), dict(JSON_CT))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_send, base, first)
        _wait_running(base, 1)
        r2 = _send(base, second)
        return [r2, fut.result()]


LOOP_BLOCK_MAX_S = 1.0  # one request may hold the event loop (so /health) at most this long


def _scenario_loop_blocker(base: str, case: Case) -> list[Result]:
    """Send ``case`` alone while /health is polled every 50 ms: an expensive request must
    be refused early or worked on off the event loop, never stall every other client."""
    probe = _HealthProbe(base, period=0.05)
    probe.start()
    try:
        time.sleep(0.1)
        res = _send(base, case)
        time.sleep(0.1)
    finally:
        probe.stop.set()
        probe.join()
    if probe.worst > LOOP_BLOCK_MAX_S:
        res.note = (f"FAIL the event loop was blocked: /health took {probe.worst:.1f} s while this request "
                    f"ran ({res.elapsed:.1f} s; HTTP {res.status}: {res.body[:150]!r})")
    return [res]


# ---- the test ---------------------------------------------------------------------------
def _known_bug(case: Case) -> Optional[KnownBug]:
    for bug in KNOWN_PRODUCT_BUGS:
        try:
            if bug.matches(case):
                return bug
        except Exception:  # a matcher must never break the run
            continue
    return None


class _HealthProbe(threading.Thread):
    """GET /health every ``period`` s; records the worst latency (a blocked event loop shows)."""

    def __init__(self, base: str, period: float = 0.2):
        super().__init__(daemon=True)
        self.base, self.period = base, period
        self.stop, self.worst, self.failures = threading.Event(), 0.0, []

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=REQUEST_TIMEOUT_S) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    s = c.get("/health").status_code
                    if s != 200:
                        self.failures.append(f"/health answered {s}")
                except httpx.HTTPError as e:
                    self.failures.append(f"/health: {type(e).__name__}: {e}")
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.stop.wait(self.period)


def _greedy(base: str) -> list[int]:
    r = httpx.post(base + "/generate", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@dataclasses.dataclass
class FuzzReport:
    results: list[Result]
    failures: list[tuple[Result, str]]
    skipped: list[tuple[Case, KnownBug]]
    n_concurrent: int
    elapsed: float
    t_concurrent: float
    worst_health: float
    problems: list[str]  # server-level problems (health, in-flight, greedy, time)
    n_late: int = 0  # concurrent cases not sent: the run's deadline had passed

    def summary(self) -> str:
        by_status = collections.Counter(r.status if r.status is not None else "none" for r in self.results)
        by_category: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for r in self.results:
            by_category[r.case.category][r.status if r.status is not None else "none"] += 1
        slowest = sorted(self.results, key=lambda r: -r.elapsed)[:5]
        lines = [f"fuzz: {len(self.results)} requests ({self.n_concurrent} concurrent on {WORKERS} threads, "
                 f"{len(self.results) - self.n_concurrent} in sequential scenarios), {len(self.skipped)} "
                 f"known-bug cases not sent, {self.n_late} not sent after the deadline; "
                 f"{self.elapsed:.1f} s ({self.t_concurrent:.1f} s concurrent); "
                 f"worst /health latency {self.worst_health:.2f} s",
                 "status codes: " + str(dict(sorted(by_status.items(), key=lambda kv: str(kv[0]))))]
        lines += [f"  {cat:17s} {dict(sorted(c.items(), key=lambda kv: str(kv[0])))}"
                  for cat, c in sorted(by_category.items())]
        lines.append("slowest: " + "; ".join(f"{r.elapsed:.1f}s {r.case.category}/{_safe(r.case.name[:50])}"
                                             for r in slowest))
        per_cat = collections.Counter()
        for r in self.results:
            per_cat[r.case.category] += r.elapsed
        lines.append("request-seconds per category: " + ", ".join(f"{c} {t:.0f}" for c, t in per_cat.most_common()))
        for bug in KNOWN_PRODUCT_BUGS:
            n = sum(1 for _, b in self.skipped if b is bug)
            lines.append(f"  known product bug, {n} cases not sent: {bug.name}")
        return "\n".join(lines)


def tp2_subset(cases: list[Case]) -> list[Case]:
    """The TP=2 run's cases: a seeded sample of TP2_FRACTION of each category (at least
    TP2_MIN_PER_CATEGORY; TP2_API_FRACTION of the api_* categories), every scenario (aborts, disconnects and duplicate rids reach
    every rank) and no loop blocker (frontend-only, as at TP=1); in the generator's order."""
    rng = random.Random(SEED + 2)
    by_cat: dict[str, list[int]] = collections.defaultdict(list)
    for i, c in enumerate(cases):
        by_cat[c.category].append(i)
    keep: set[int] = set()
    for cat, idx in by_cat.items():
        if cat == "loop_blocker":
            continue
        if cat == "scenario":
            keep.update(idx)
            continue
        frac = TP2_API_FRACTION if cat.startswith("api_") else TP2_FRACTION
        k = min(len(idx), max(TP2_MIN_PER_CATEGORY, round(len(idx) * frac)))
        keep.update(rng.sample(idx, k))
    return [c for i, c in enumerate(cases) if i in keep]


def run_fuzz(base: str, cases: Optional[list[Case]] = None, budget_s: float = FUZZ_BUDGET_S,
             deadline_s: Optional[float] = None) -> FuzzReport:
    """``deadline_s``: concurrent cases not started by then are not sent (counted in the
    summary), so the run stays bounded in time on a slow machine."""
    reference = _greedy(base)
    cases = FuzzGen(SEED).build() if cases is None else cases
    skipped = [(c, bug) for c in cases if (bug := _known_bug(c)) is not None]
    skipped_ids = {id(c) for c, _ in skipped}
    concurrent_cases = [c for c in cases if c.runner is None and id(c) not in skipped_ids]
    scenario_cases = [c for c in cases if c.runner is not None and id(c) not in skipped_ids]

    probe = _HealthProbe(base)
    probe.start()
    t0 = time.perf_counter()

    def send(c: Case) -> Optional[Result]:
        if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
            return None
        return _send(base, c)

    try:
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            sent = list(pool.map(send, concurrent_cases))
        t_concurrent = time.perf_counter() - t0
    finally:
        probe.stop.set()
        probe.join()
    results = [r for r in sent if r is not None]
    n_late = len(sent) - len(results)
    for case in scenario_cases:  # sequential: each measures or aborts on an otherwise idle server
        try:
            results.extend(case.runner(base))
        except Exception as e:  # the scenario itself broke: report it as this case's failure
            results.append(Result(case, None, error=f"scenario raised {type(e).__name__}: {e}"))
    elapsed = time.perf_counter() - t0

    problems = []
    health = httpx.get(base + "/health", timeout=10).status_code
    if health != 200:
        problems.append(f"/health is {health} after the fuzz")
    deadline, inflight = time.time() + 15, None
    while time.time() < deadline:
        inflight = httpx.get(base + "/get_server_info", timeout=10).json()["num_inflight_requests"]
        if inflight == 0:
            break
        time.sleep(0.2)
    if inflight != 0:
        problems.append(f"{inflight} requests still in flight 15 s after the fuzz")
    after = _greedy(base)
    if after != reference:
        problems.append(f"greedy output changed by the fuzz: {reference} -> {after}")
    if probe.failures:
        problems.append(f"/health failed during the fuzz: {probe.failures[:3]}")
    if probe.worst > HEALTH_MAX_LATENCY_S:
        problems.append(f"/health took {probe.worst:.1f} s during the fuzz (event loop blocked?)")
    if elapsed > budget_s:
        problems.append(f"the fuzz took {elapsed:.1f} s (budget {budget_s:.0f} s)")
    failures = [(r, why) for r in results if (why := check(r)) is not None]
    return FuzzReport(results, failures, skipped, len(concurrent_cases) - n_late, elapsed, t_concurrent,
                      probe.worst, problems, n_late)


def test_generator_is_seeded_and_covers_every_endpoint():
    a, b = FuzzGen(SEED).build(), FuzzGen(SEED).build()
    assert [(c.method, c.path, c.body) for c in a] == [(c.method, c.path, c.body) for c in b]
    assert len(a) >= MIN_CASES
    assert set(POST_ROUTES) | set(GET_ROUTES) <= {c.path for c in a}
    assert {"PUT", "DELETE", "GET", "POST", "PATCH", "HEAD", "OPTIONS"} <= {c.method for c in a}
    assert len([c for c in a if _known_bug(c) is None]) >= MIN_CASES  # still >= 1,000 sent


def _assert_clean(report: FuzzReport) -> None:
    problems = [_safe(f"{why}\n      <- {r.case.short()}") for r, why in report.failures] + report.problems
    assert not problems, f"{len(problems)} problem(s):\n  " + "\n  ".join(p[:700] for p in problems[:80])


def test_fuzz_requests(server):
    report = run_fuzz(server)
    print("\n[TP=1] " + report.summary())
    _assert_clean(report)


def test_tp2_subset_is_seeded_and_covers_every_category():
    cases = FuzzGen(SEED).build()
    a, b = tp2_subset(cases), tp2_subset(FuzzGen(SEED).build())
    assert [(c.path, c.body) for c in a] == [(c.path, c.body) for c in b]
    assert {c.category for c in a} == {c.category for c in cases} - {"loop_blocker"}
    assert 150 <= len(a) <= 300, len(a)


@pytest.mark.timeout(240)
def test_fuzz_requests_tp2(tp2_server):
    """The same checks against the session's ``--tp-size 2`` server (``tp2_server``), on a
    seeded subset of the cases (``tp2_subset``) and bounded in time (TP2_DEADLINE_S)."""
    base, _ = tp2_server
    report = run_fuzz(base, tp2_subset(FuzzGen(SEED).build()), budget_s=TP2_BUDGET_S, deadline_s=TP2_DEADLINE_S)
    print("\n[TP=2] " + report.summary())
    _assert_clean(report)
