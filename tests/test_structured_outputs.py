"""Structured outputs end to end on a real server (embedded SmolLM2, greedy): ``strict`` is a
guarantee (a 400 naming each keyword no grammar enforces, with its JSON path), a non-strict
schema is served by an approximate grammar whose finished document is validated against the
full schema (``schema_violation``), pydantic discriminated unions are exact, and the
validation stats and metrics count what they should."""
from __future__ import annotations

import json
from typing import Literal, Union

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from test_metrics import samples, value

pytestmark = pytest.mark.timeout(240)  # fixture setup (a server start) counts

TAGS_PROMPT = "List three tags for a blog post about cats as JSON."
# Three tags from a two-word vocabulary, all different: every document breaks uniqueItems,
# whatever the model prefers (its greedy choice differs between bf16 and fp32).
TAGS = {"type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["cats", "pets"]}, "uniqueItems": True,
                                "minItems": 3, "maxItems": 3}},
        "required": ["tags"]}
CAPITAL_PROMPT = "What is the capital of France? Answer in JSON."
NOT_PARIS = {"type": "object", "properties": {"answer": {"type": "string", "not": {"const": "Paris"}}},
             "required": ["answer"]}
PLAIN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# case -> (prompt, schema, the approximation reported, (keyword, path, schema_path) of the
# violation the greedy answer commits)
CASES = {
    "uniqueItems": (TAGS_PROMPT, TAGS, "uniqueItems at #/properties/tags",
                    ("uniqueItems", "#/tags", "#/properties/tags/uniqueItems")),
    "not": (CAPITAL_PROMPT, NOT_PARIS, "not at #/properties/answer",
            ("not", "#/answer", "#/properties/answer/not")),
}
BACKENDS = ("xgrammar", "llguidance")


def chat_body(prompt: str, schema: dict, strict=None, **extra) -> dict:
    spec = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 60,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": spec}, **extra}


def chat(base: str, prompt: str, schema: dict, strict=None) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=chat_body(prompt, schema, strict), timeout=60)


def served_choice(base: str, prompt: str, schema: dict) -> dict:
    r = chat(base, prompt, schema)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def validations(base: str) -> int:
    return httpx.get(base + "/get_server_info", timeout=10).json()["schema_validation"]["validations"]


@pytest.fixture(scope="module")
def answers(server_auto) -> dict:
    """The non-strict (approximate) chat answer of each case, one request each, shared."""
    return {case: served_choice(server_auto, prompt, schema)
            for case, (prompt, schema, _, _) in CASES.items()}


# ---- strict: a guarantee or a 400 -------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_strict_is_refused_naming_keyword_and_path(server_auto, case):
    prompt, schema, approximated, _ = CASES[case]
    r = chat(server_auto, prompt, schema, strict=True)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert f"no grammar library enforces: {approximated}." in err["message"], err["message"]
    assert "Without strict" in err["message"]

    r = httpx.post(server_auto + "/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                            "json_schema": json.dumps(schema), "json_schema_strict": True}})
    assert r.status_code == 400, r.text
    assert f"no grammar library enforces: {approximated}." in r.json()["error"]["message"]


@pytest.mark.parametrize("case", CASES)
def test_without_strict_the_same_schema_is_served_approximately(answers, case):
    _, _, approximated, _ = CASES[case]
    choice = answers[case]
    assert choice["grammar"]["exact"] is False
    assert choice["grammar"]["backend"] in BACKENDS
    assert choice["grammar"]["approximated"] == [approximated]


def test_strict_on_the_xgrammar_backend_names_the_backend(server):
    """Every backend keeps the guarantee: a pinned xgrammar says what it does not enforce."""
    r = chat(server, TAGS_PROMPT, TAGS, strict=True)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "the xgrammar grammar backend does not enforce: uniqueItems at #/properties/tags." in msg, msg


# ---- approximate grammars: the finished document is validated -----------------------------


@pytest.mark.parametrize("case", CASES)
def test_violation_is_reported_not_stop(answers, case):
    _, _, _, (keyword, path, schema_path) = CASES[case]
    choice = answers[case]
    assert choice["finish_reason"] == "schema_violation"
    v = choice["schema_violation"]
    assert (v["keyword"], v["path"], v["schema_path"]) == (keyword, path, schema_path), v
    assert v["message"] and set(v) == {"message", "keyword", "path", "schema_path"}
    document = json.loads(choice["message"]["content"])  # the text is still returned
    if case == "uniqueItems":
        assert len(document["tags"]) == 3 and len(set(document["tags"])) < 3, document
        assert "non-unique" in v["message"]
    else:
        assert document == {"answer": "Paris"}


def test_native_generate_reports_the_violation_in_finish_reason(server_auto, smollm2_tokenizer, answers):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": TAGS_PROMPT}],
                                                 tokenize=False, add_generation_prompt=True)
    r = httpx.post(server_auto + "/generate", timeout=60, json={
        "text": text, "sampling_params": {"max_new_tokens": 60, "temperature": 0,
                                          "json_schema": json.dumps(TAGS)}})
    assert r.status_code == 200, r.text
    out = r.json()
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "schema_violation", fr
    assert (fr["keyword"], fr["path"], fr["schema_path"]) == (
        "uniqueItems", "#/tags", "#/properties/tags/uniqueItems"), fr
    assert fr["message"] and "matched" in fr
    assert out["meta_info"]["grammar"] == answers["uniqueItems"]["grammar"]
    assert out["text"] == answers["uniqueItems"]["message"]["content"]  # same prompt tokens, greedy


def test_stream_final_chunk_carries_the_violation(server_auto, answers):
    expected = answers["uniqueItems"]
    chunks = []
    with httpx.stream("POST", server_auto + "/v1/chat/completions", timeout=60,
                      json=chat_body(TAGS_PROMPT, TAGS, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finished = [c for c in choices if c["finish_reason"] is not None]
    assert len(finished) == 1 and finished[0] is choices[-1]
    final = finished[0]
    assert final["finish_reason"] == "schema_violation"
    assert final["schema_violation"] == expected["schema_violation"]
    assert final["grammar"] == expected["grammar"]
    # only the final chunk carries them
    assert not any("grammar" in c or "schema_violation" in c for c in choices[:-1])
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == expected["message"]["content"]


# ---- exact grammars -----------------------------------------------------------------------


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="pet_type")
    name: str


def test_pydantic_discriminated_union_parses_strictly(server_auto):
    """The openai client's parse() sends strict: true and a oneOf over the discriminator's
    consts: an exact grammar serves it (no 400)."""
    client = openai.OpenAI(base_url=server_auto + "/v1", api_key="none", timeout=60, max_retries=0)
    completions = client.chat.completions if hasattr(client.chat.completions, "parse") \
        else client.beta.chat.completions
    raw = completions.with_raw_response.parse(
        model="smollm2", response_format=Owner, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Alice has a cat that meows 3 times a day. "
                                              "Describe the owner as JSON."}])
    sent = json.loads(raw.http_request.content)["response_format"]["json_schema"]
    assert sent["strict"] is True and "oneOf" in json.dumps(sent["schema"])
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Owner), choice.message
    assert isinstance(choice.message.parsed.pet, (Cat, Dog))
    assert choice.model_extra["grammar"]["exact"] is True
    assert choice.model_extra["grammar"]["approximated"] == []


def test_exact_grammars_pay_no_validation(server_auto):
    before = validations(server_auto)
    choice = served_choice(server_auto, "Give me a JSON object with an integer a.", PLAIN)
    assert choice["finish_reason"] == "stop"
    assert choice["grammar"]["exact"] is True and choice["grammar"]["approximated"] == []
    assert "schema_violation" not in choice
    assert validations(server_auto) == before

    # An approximate grammar whose document satisfies the schema: validated once, "stop".
    choice = served_choice(server_auto, "What is the capital of Germany? Answer in JSON.", NOT_PARIS)
    assert choice["grammar"]["exact"] is False
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["answer"] != "Paris"
    assert validations(server_auto) == before + 1


# ---- metrics --------------------------------------------------------------------------------


def test_metrics_count_approximations_and_violations(server):
    def counters() -> tuple[float, float]:
        parsed = samples(httpx.get(server + "/metrics", timeout=10).text)
        labels = {"model_name": "smollm2", "backend": "xgrammar"}
        return (value(parsed, "gramsync:grammar_approximated_requests_total", **labels),
                value(parsed, "gramsync:schema_violations_total", **labels))

    approximated, violations = counters()
    choice = served_choice(server, TAGS_PROMPT, TAGS)
    assert choice["grammar"] == {"backend": "xgrammar", "exact": False,
                                 "approximated": ["uniqueItems at #/properties/tags"]}
    assert choice["finish_reason"] == "schema_violation", choice  # greedy xgrammar repeats a tag too
    assert choice["schema_violation"]["keyword"] == "uniqueItems"
    assert counters() == (approximated + 1, violations + 1)
