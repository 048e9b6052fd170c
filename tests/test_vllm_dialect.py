"""vLLM's structured-output dialect (srt/entrypoints/vllm_dialect.py): each field and its
legacy ``guided_*`` name map onto our constraint kinds; two fields giving a constraint
(in any mix of dialects) are a 400 naming both; disable_additional_properties rewrites the
schema; the whitespace options travel in the spec (so in the grammar cache key) and the
backends honour them per request. The last tests drive the session's real server (xgrammar)
through the official `openai` client with ``extra_body``."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import ValidationError

from constrained.grammar_config import JSON_LAYOUT_KEY, GrammarBackendConfig, JsonOptions, split_json_layout
from srt.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, validation_error_message
from srt.entrypoints.vllm_dialect import close_object_schemas
from srt.frontend.generate_input import prepare_request
from srt.transport.io_struct import SchedulerInfo

MSGS = [{"role": "user", "content": "hi"}]
INFO = SchedulerInfo(max_total_num_tokens=4096, max_running_requests=8, context_len=8192,
                     vocab_size=1000, eos_token_ids=(2,))
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}
CANON = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["b","a"]}'
TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
       "triggers": ["<f>"]}


def _constraint(body: dict):
    """(kind, spec) the completion ``body`` resolves to, through the server's path."""
    req = CompletionRequest.model_validate({"prompt": [5, 6], **body})
    return prepare_request(req.generate_input("rid", input_ids=req.prompts()[0]), None, INFO,
                           grammar_backend="xgrammar").sampling_params.constraint


def _chat_error(body: dict) -> str:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": MSGS, **body})
    return validation_error_message(e.value)[0]


# ---- mapping ----------------------------------------------------------------------------
@pytest.mark.parametrize("body,expected", [
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", CANON)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, ("json_schema", CANON)),
    ({"guided_json": SCHEMA}, ("json_schema", CANON)),
    ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", CANON)),
    ({"structured_outputs": {"json_object": True}}, ("json_schema", '{"type":"object"}')),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"structured_outputs": {}}, None),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
    ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("ebnf", 'root ::= "a"')),
    ({"guided_grammar": 'root ::= "a"'}, ("ebnf", 'root ::= "a"')),
    ({"structured_outputs": {"structural_tag": TAG}}, ("structural_tag", json.dumps(TAG, separators=(",", ":")))),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     ("structural_tag", json.dumps(TAG, separators=(",", ":")))),
    # neutral option values change nothing
    ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": False,
                                                    "disable_additional_properties": False}},
     ("json_schema", CANON)),
])
def test_each_field_maps_to_our_constraint(body, expected):
    assert _constraint(body) == expected


def test_both_dialects_share_one_cache_key_and_chat_maps_the_same():
    ours = _constraint({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert ours == _constraint({"guided_json": SCHEMA}) == _constraint({"json_schema": json.dumps(SCHEMA)})
    sp = ChatCompletionRequest(messages=MSGS, structured_outputs={"grammar": 'root ::= "a"'}).sampling_params()
    assert sp["ebnf"] == 'root ::= "a"' and "regex" not in sp
    sp = ChatCompletionRequest(messages=MSGS, guided_choice=["a", "b"]).sampling_params()
    assert sp["choice"] == ["a", "b"]


# ---- conflicts and bad values: 400s naming the fields -------------------------------------
@pytest.mark.parametrize("body,msg", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
     "response_format and guided_json both give a constraint: use one."),
    ({"regex": "a+", "structured_outputs": {"regex": "b+"}},
     "regex and structured_outputs.regex both give a constraint: use one."),
    ({"guided_regex": "a+", "guided_choice": ["a"]},
     "Only one constraint kind per request is allowed, got guided_regex and guided_choice."),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}},
     "Only one constraint kind per request is allowed, got structured_outputs.json and structured_outputs.regex."),
    ({"ebnf": 'root ::= "a"', "structured_outputs": {"json_object": True}},
     "Only one constraint kind per request is allowed, got ebnf and structured_outputs.json_object."),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA},
     "response_format and structured_outputs.json and guided_json all give a constraint"),
    # our own fields keep their messages
    ({"regex": "a+", "ebnf": "root ::= 'a'"}, "Only one constraint kind per request is allowed, got regex and ebnf."),
    # the JSON options
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?", "structured_outputs": {"whitespace_pattern": "[ ]?"}},
     "structured_outputs.whitespace_pattern and guided_whitespace_pattern both set the whitespace"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": "[ ]?"}},
     "structured_outputs.disable_any_whitespace and structured_outputs.whitespace_pattern both set"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace applies to JSON constraints only"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "},
     "but the request has a choice constraint (guided_choice)"),
    ({"structured_outputs": {"disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties applies to JSON constraints only (json, json_object, "
     "guided_json, response_format json_schema/json_object), but the request has no constraint."),
    # bad values name the field they came in
    ({"guided_json": "{oops"}, "guided_json is not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json: json_schema must be a JSON object"),
    ({"guided_choice": []}, "guided_choice: choice must be a non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice: choice must be a list of non-empty"),
    ({"structured_outputs": {"structural_tag": "[]"}},
     "structured_outputs.structural_tag: structural_tag must be a JSON object"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend: unknown field"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend: unknown field"),
])
def test_conflicts_and_bad_values_are_400s_naming_the_fields(body, msg):
    assert msg in _chat_error(body)
    with pytest.raises(ValidationError) as e:  # completions: the same, at validation time
        _constraint(body)
    assert msg in validation_error_message(e.value)[0]


def test_completions_json_schema_conflicts_with_guided_json():
    with pytest.raises(ValueError, match="json_schema and guided_json both give a constraint"):
        _constraint({"json_schema": SCHEMA, "guided_json": SCHEMA})


# ---- disable_additional_properties --------------------------------------------------------
def test_disable_additional_properties_closes_object_schemas():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "tags": {"type": "object", "patternProperties": {"^t_": {"type": "string"}}},
            "list": {"type": "array", "items": {"properties": {"z": {}}}},
            # a property named "properties" is a name, not a keyword
            "properties": {"type": "string"},
            "data": {"const": {"properties": {"k": 1}}, "enum": [{"properties": {}}]},
        },
        "$defs": {"D": {"properties": {"d": {}}}, "Shared": {"properties": {"s": {}}}},
        "allOf": [{"properties": {"p": {}}}, {"$ref": "#/$defs/Shared"}],
        "anyOf": [{"properties": {"q": {}}}],
    }
    before = json.dumps(schema)
    out = close_object_schemas(schema)
    assert json.dumps(schema) == before  # the request's schema is not modified
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["inner"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True  # an explicit value is kept
    assert p["tags"]["additionalProperties"] is False  # patternProperties too (as vLLM)
    assert p["list"]["items"]["additionalProperties"] is False
    assert set(p) == {"inner", "open", "tags", "list", "properties", "data"}
    assert p["data"] == schema["properties"]["data"]  # data is left alone
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    # closing allOf branches (or what they refer to) would make the conjunction unsatisfiable
    assert "additionalProperties" not in out["allOf"][0]
    assert "additionalProperties" not in out["$defs"]["Shared"]
    assert close_object_schemas(True) is True


def test_disable_additional_properties_reaches_the_spec():
    schema = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}
    plain = _constraint({"guided_json": schema})
    closed = _constraint({"structured_outputs": {"json": schema, "disable_additional_properties": True}})
    assert json.loads(closed[1]) == {**schema, "additionalProperties": False}
    assert plain != closed
    # also on a constraint given through our own fields
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert _constraint({"response_format": rf, "structured_outputs": {"disable_additional_properties": True}}) == closed


# ---- whitespace options: in the spec, read by the backends per request ---------------------
def test_whitespace_options_travel_in_the_spec():
    kind, spec = _constraint({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert kind == "json_schema" and json.loads(spec)[JSON_LAYOUT_KEY] == {"disable_any_whitespace": True}
    kind, spec2 = _constraint({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"})
    assert json.loads(spec2)[JSON_LAYOUT_KEY] == {"whitespace_pattern": "[ ]?"}
    assert len({spec, spec2, CANON}) == 3  # three grammar cache keys
    # json_object, and a boolean schema (as an equivalent object)
    _, spec3 = _constraint({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert json.loads(spec3) == {"type": "object", JSON_LAYOUT_KEY: {"disable_any_whitespace": True}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    _, spec4 = _constraint({"response_format": rf, "guided_whitespace_pattern": " ?"})
    assert json.loads(spec4) == {JSON_LAYOUT_KEY: {"whitespace_pattern": " ?"}}
    # the backends' view: the schema without the keyword, the request's options
    server = JsonOptions(disable_any_whitespace=False, whitespace_pattern="[\n]?", max_whitespace=4)
    stripped, opts = split_json_layout(spec, server)
    assert json.loads(stripped) == SCHEMA
    assert opts.disable_any_whitespace and opts.whitespace_pattern is None and opts.max_whitespace == 4
    stripped, opts = split_json_layout(spec2, JsonOptions(disable_any_whitespace=True))
    assert not opts.disable_any_whitespace and opts.whitespace_pattern == "[ ]?"
    assert split_json_layout(CANON, server) == (CANON, server)
    with pytest.raises(ValueError, match=JSON_LAYOUT_KEY):
        split_json_layout(json.dumps({JSON_LAYOUT_KEY: {"disable_any_whitespace": False}}), server)


def _accepts(grammar, tokenizer, text: str) -> bool:
    from constrained.bitmask_ops import allocate_token_bitmask, unpack_bitmask

    mask = allocate_token_bitmask(1, 49152)
    try:
        for tok in tokenizer.encode(text):
            grammar.fill_vocab_mask(mask, 0)
            if not unpack_bitmask(mask, 49152)[0, tok]:
                return False
            grammar.accept_token(tok)
    except ValueError:
        return False
    return True


def test_backends_apply_the_whitespace_per_request(smollm2_tokenizer):
    from constrained.auto_backend import AutoGrammarBackend
    from constrained.base_grammar_backend import InvalidGrammarObject
    from constrained.llguidance_backend import GuidanceBackend
    from constrained.outlines_backend import OutlinesGrammarBackend
    from constrained.xgrammar_backend import XGrammarGrammarBackend

    tok, cfg = smollm2_tokenizer, GrammarBackendConfig(49152, (2,), JsonOptions())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = _constraint({"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    newline = _constraint({"guided_json": schema, "guided_whitespace_pattern": r"[\n]?"})
    xgr = XGrammarGrammarBackend.from_tokenizer(tok, cfg)
    llg = GuidanceBackend.from_tokenizer(tok, cfg)
    outlines = OutlinesGrammarBackend.from_tokenizer(tok, cfg)
    for backend in (xgr, llg, outlines):
        plain = backend.init_value(("json_schema", json.dumps(schema)))
        assert _accepts(plain, tok, '{"a": 1}'), backend.name  # the server's default
        g = backend.init_value(compact)
        assert _accepts(g.copy(), tok, '{"a":1}'), backend.name
        assert not _accepts(g.copy(), tok, '{"a": 1}'), backend.name
    for backend in (llg, outlines):
        g = backend.init_value(newline)
        assert _accepts(g.copy(), tok, '{\n"a":\n1}') and not _accepts(g.copy(), tok, '{ "a": 1}'), backend.name
    # xgrammar has no whitespace patterns: refused, never ignored; auto serves it with llguidance
    bad = xgr.init_value(newline)
    assert isinstance(bad, InvalidGrammarObject) and "--grammar-backend llguidance" in bad.message
    auto = AutoGrammarBackend(xgr, llg, cfg)
    g = auto.init_value(newline)
    assert g.stats.dispatch_type == "llguidance"  # its first choice for JSON schemas anyway
    assert _accepts(g.copy(), tok, '{\n"a":\n1}') and not _accepts(g.copy(), tok, '{ "a": 1}')
    assert auto.init_value(compact).stats.dispatch_type == "llguidance"

    class Plain(XGrammarGrammarBackend):  # a third-party backend that never heard of it
        name = "plain"
        supports_json_layout = False

    bad = Plain.from_tokenizer(tok, cfg).init_value(compact)
    assert isinstance(bad, InvalidGrammarObject) and JSON_LAYOUT_KEY in bad.message


# ---- end to end through the real server (xgrammar) and the openai client ------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.mark.timeout(300)
def test_http_structured_outputs_and_guided_fields(client):
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=60, temperature=0,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model="smollm2", prompt="A person as JSON:", max_tokens=60, temperature=0,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(
        model="smollm2", prompt="A person as JSON:", max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    obj = json.loads(r.choices[0].text)
    jsonschema.validate(obj, PERSON)
    assert r.choices[0].text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Is it raining?"}],
                                       max_tokens=5, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smollm2", prompt="Today is ", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text)


def test_http_conflicts_and_unsupported_options_are_400s(server, client):
    with pytest.raises(openai.BadRequestError, match="response_format and guided_json both give a constraint"):
        client.chat.completions.create(model="smollm2", messages=MSGS, max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"guided_json": PERSON})
    with pytest.raises(openai.BadRequestError, match="regex and structured_outputs.regex"):
        client.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                  extra_body={"regex": "a", "structured_outputs": {"regex": "b"}})
    # xgrammar (this server) has no whitespace patterns: a 400 that says what to use
    r = httpx.post(server + "/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "x", "max_tokens": 4, "guided_json": PERSON, "guided_whitespace_pattern": " ?"})
    assert r.status_code == 400 and "--grammar-backend llguidance" in r.json()["error"]["message"], r.text
