"""Grammar-constrained generation end to end: the corpus in ``grammar_corpus.py`` through the
REAL servers (conftest: ``server`` = xgrammar, ``server_llguidance``, ``server_auto``), over the
native /generate endpoint and the OpenAI chat / completions endpoints, plus mixed batches,
``choice``, ``json_object`` and the error paths.

Every request is sent concurrently with others (the server batches them: much faster than one
at a time on 2 CPU cores), greedy, with a client timeout. A request whose grammar finished
(finish_reason "stop") must validate with the corpus' independent validators; one that ran out
of tokens ("length") must be a valid prefix (checked with llguidance, see PrefixChecker).
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import grammar_corpus as gc

REQUEST_TIMEOUT_S = 240  # per request (a whole corpus shares 2 CPU cores)
WORKERS = 32
# Share of a backend's corpus that must finish its grammar ("stop") within max_tokens:
# observed 100% on all three backends (89% before the EBNF repetitions were bounded).
MIN_STOP_RATE = 0.85


# ---- plumbing ------------------------------------------------------------------------------
def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _chat_text(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _generate(base: str, text: str, max_new_tokens: int, **sampling) -> httpx.Response:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}}
    return httpx.post(base + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)


class Outcome:
    """What one request of the corpus came back with."""

    def __init__(self, case: gc.Case, path: str):
        self.case, self.path = case, path
        self.status: int | None = None
        self.text = ""
        self.finish: str | None = None
        self.error: str | None = None
        self.invalid: str | None = None  # why the output is not valid ("stop") / a valid prefix ("length")
        self.seconds = 0.0

    def __repr__(self) -> str:
        head = f"{self.case.name:24s} {self.case.kind:11s} {self.path:11s} {self.status} {self.finish}"
        tail = f" ERROR {self.error}" if self.error else f" {self.text!r}"
        return head + f" {self.seconds:5.1f}s" + tail + (f"\n    INVALID: {self.invalid}" if self.invalid else "")


def _constraint(case: gc.Case, as_string: bool) -> dict:
    spec = case.spec_str if (as_string or case.kind != "json_schema") else case.spec
    return {case.kind: spec}


def _run_case(base: str, tok, case: gc.Case, path: str) -> Outcome:
    """``path``: native (spec as an object) | native_str (json_schema as a string) | chat
    (json_schema via response_format, regex/ebnf via extra_body) | completions (extra_body)."""
    out = Outcome(case, path)
    t0 = time.time()
    try:
        if path.startswith("native"):
            r = _generate(base, _chat_text(tok, case.messages), case.max_tokens,
                          **_constraint(case, path == "native_str"))
            out.status = r.status_code
            if r.status_code == 200:
                body = r.json()
                out.text, out.finish = body["text"], body["meta_info"]["finish_reason"]["type"]
            else:
                out.error = r.text[:500]
        elif path == "chat":
            kw = ({"response_format": {"type": "json_schema", "json_schema": {
                "name": case.name, "schema": case.spec, "strict": True}}}
                if case.kind == "json_schema" else {"extra_body": {case.kind: case.spec}})
            r = _client(base).chat.completions.create(
                model="smollm2", messages=case.messages, max_tokens=case.max_tokens, temperature=0, **kw)
            out.status, out.text, out.finish = 200, r.choices[0].message.content, r.choices[0].finish_reason
        else:
            r = _client(base).completions.create(
                model="smollm2", prompt=_chat_text(tok, case.messages), max_tokens=case.max_tokens,
                temperature=0, extra_body=_constraint(case, as_string=True))
            out.status, out.text, out.finish = 200, r.choices[0].text, r.choices[0].finish_reason
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, str(e)[:500]
    except Exception as e:  # noqa: BLE001 - reported per case below
        out.error = f"{type(e).__name__}: {e}"[:500]
    out.seconds = time.time() - t0
    if out.status == 200 and out.finish == "stop":
        out.invalid = case.why_invalid(out.text)
    return out


PATHS = ("native", "chat", "native_str", "completions")


def _run_corpus(base: str, tok, cases: list[gc.Case]) -> list[Outcome]:
    jobs = [(c, PATHS[i % len(PATHS)]) for i, c in enumerate(cases)]
    with ThreadPoolExecutor(WORKERS) as pool:
        outcomes = list(pool.map(lambda job: _run_case(base, tok, *job), jobs))
    prefix = gc.PrefixChecker(tok)
    for o in outcomes:  # a truncated output must still be a valid prefix
        if o.status == 200 and o.finish == "length":
            o.invalid = prefix.why_not_prefix(o.case, o.text)
    return outcomes


def _report(backend: str, outcomes: list[Outcome], seconds: float) -> str:
    stops = sum(o.finish == "stop" for o in outcomes)
    lines = [f"[{backend}] {len(outcomes)} cases in {seconds:.1f} s, "
             f"stop {stops}/{len(outcomes)} ({stops / max(len(outcomes), 1):.0%})"]
    return "\n".join(lines + [repr(o) for o in outcomes])


# ---- offline: the corpus itself (no server) -----------------------------------------------
def test_corpus_shape():
    counts = gc.counts()
    assert len(gc.CASES) >= 40 and all(n >= 10 for n in counts.values()), counts
    assert gc.check_examples() == {}


@pytest.mark.timeout(120)
def test_corpus_compiles_with_both_libraries(smollm2_tokenizer):
    """Every spec compiles with xgrammar and llguidance (flagged cases: llguidance only), and
    each compiled grammar accepts the case's hand-written valid example."""
    assert gc.check_xgrammar(smollm2_tokenizer) == {}
    assert gc.check_llguidance(smollm2_tokenizer) == {}
    prefix = gc.PrefixChecker(smollm2_tokenizer)
    for c in gc.CASES:  # the prefix check used on truncated outputs can pass and fail
        assert prefix.why_not_prefix(c, c.example_valid[: len(c.example_valid) // 2]) is None, c.name
    assert prefix.why_not_prefix(gc.BY_NAME["iso_date"], "1969-13") is not None
    assert prefix.why_not_prefix(gc.BY_NAME["person_basic"], '{"name": 3') is not None


# ---- the corpus through each backend -------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend,fixture", [("xgrammar", "server"), ("llguidance", "server_llguidance"),
                                             ("auto", "server_auto")])
def test_corpus_end_to_end(request, smollm2_tokenizer, backend, fixture):
    base = request.getfixturevalue(fixture)
    cases = gc.cases_for(backend)
    t0 = time.time()
    outcomes = _run_corpus(base, smollm2_tokenizer, cases)
    report = _report(backend, outcomes, time.time() - t0)
    print(report)
    assert all(o.status == 200 for o in outcomes), report
    assert not [o for o in outcomes if o.invalid], report
    assert not [o for o in outcomes if o.finish not in ("stop", "length")], report
    stops = sum(o.finish == "stop" for o in outcomes)
    assert stops >= MIN_STOP_RATE * len(outcomes), report


# ---- mixed batches --------------------------------------------------------------------------
UNCONSTRAINED = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
                 "The three primary colors are"]
MIXED_CONSTRAINED = ["person_basic", "iso_date", "robot_command", "equation", "enum_color", "ipv4",
                     "pattern_with_length"]  # the last one goes to llguidance under auto
FRUITS = ["apple", "banana", "cherry"]


@pytest.mark.timeout(400)
def test_unconstrained_outputs_unchanged_by_constrained_neighbours(server_auto, smollm2_tokenizer):
    tok = smollm2_tokenizer

    def plain(prompt):
        r = _generate(server_auto, prompt, 24)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(UNCONSTRAINED)) as pool:
        alone = list(pool.map(plain, UNCONSTRAINED))
    assert all(alone)

    def choice():
        r = _generate(server_auto, _chat_text(tok, [{"role": "user", "content": "Name a red fruit."}]), 8,
                      choice=FRUITS)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(_run_case, server_auto, tok, gc.BY_NAME[n], "native")
                       for n in MIXED_CONSTRAINED]
        chosen = pool.submit(choice)
        mixed = [pool.submit(plain, p) for p in UNCONSTRAINED]
        mixed = [f.result() for f in mixed]
        constrained = [f.result() for f in constrained]
        chosen = chosen.result()
    report = "\n".join(map(repr, constrained))
    assert mixed == alone, [tok.decode(x) for x in alone + mixed]
    assert all(o.status == 200 and not o.invalid for o in constrained), report
    assert sum(o.finish == "stop" for o in constrained) >= len(constrained) - 1, report
    assert chosen["text"] in FRUITS and chosen["meta_info"]["finish_reason"]["type"] == "stop", chosen


# ---- choice and json_object ----------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", ["server", "server_llguidance"])
def test_choice_and_json_object(request, smollm2_tokenizer, fixture):
    server = request.getfixturevalue(fixture)
    tok, client = smollm2_tokenizer, _client(server)
    choices = ["positive", "negative", "neutral"]
    msgs = [{"role": "user", "content": "Sentiment of 'What a wonderful day!'?"}]
    obj_msgs = [{"role": "user", "content": 'Return a JSON object with one key "city" whose value is the '
                                            'capital of France.'}]

    def native_choice():
        r = _generate(server, _chat_text(tok, msgs), 8, choice=choices)
        assert r.status_code == 200, r.text
        return r.json()["text"], r.json()["meta_info"]["finish_reason"]["type"]

    def chat_choice():
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"choice": choices})
        return r.choices[0].message.content, r.choices[0].finish_reason

    def completion_choice():  # several choices share a prefix ("yes" / "yesterday")
        r = client.completions.create(model="smollm2", prompt="Is the sky blue? Answer:", max_tokens=8,
                                      temperature=0, extra_body={"choice": ["yes", "yesterday", "no"]})
        return r.choices[0].text, r.choices[0].finish_reason

    def json_object():
        r = client.chat.completions.create(model="smollm2", messages=obj_msgs, max_tokens=64, temperature=0,
                                           response_format={"type": "json_object"})
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(f) for f in (native_choice, chat_choice, completion_choice, json_object)]
        (t1, f1), (t2, f2), (t3, f3), (t4, f4) = [f.result() for f in futs]
    assert t1 in choices and f1 == "stop", (t1, f1)
    assert (t2, f2) == (t1, "stop")  # same prompt, same template, greedy
    assert t3 in ("yes", "yesterday", "no") and f3 == "stop", (t3, f3)
    assert f4 == "stop", (t4, f4)
    assert isinstance(json.loads(t4), dict), t4


# ---- failure paths --------------------------------------------------------------------------
INVALID = [  # (sampling-params extra, expected message substring)
    # Checked against the meta-schema in the frontend (constrained/schema_validation.py).
    ({"json_schema": {"type": "strin"}}, "json_schema is not a valid JSON Schema: \"strin\" is not valid"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}},
     "json_schema is not a valid JSON Schema: Pointer '/$defs/missing' does not exist"),
    ({"regex": "a(b"}, "Failed to compile regex grammar: "),
    ({"ebnf": 'root ::= "a" undefined_rule\n'}, "Failed to compile ebnf grammar: "),
    ({"regex": "[0-9]+", "ebnf": 'root ::= "a"\n'}, "Only one constraint kind per request is allowed"),
    ({"json_schema": "{not json"}, "json_schema"),
]


def _error_message(r: httpx.Response) -> str:
    body = r.json()
    assert isinstance(body.get("error"), dict), body
    assert body["error"].get("code") in (400, None), body
    return body["error"]["message"]


def _check_invalid_requests(base: str, tok, invalid: list[tuple[dict, str]]) -> None:
    """All invalid requests at once, next to a valid one: each a 400 with its message while
    the valid one completes; then the same again (the compile failure is cached)."""
    text = _chat_text(tok, [{"role": "user", "content": "Say something."}])
    valid = gc.BY_NAME["iso_date"]

    def bad(extra):
        return _generate(base, text, 8, **extra)

    first = None
    for round_ in range(2):
        with ThreadPoolExecutor(len(invalid) + 1) as pool:
            ok = pool.submit(_run_case, base, tok, valid, "native")
            rs = list(pool.map(bad, [extra for extra, _ in invalid]))
            ok = ok.result()
        assert ok.status == 200 and not ok.invalid and ok.finish in ("stop", "length"), ok
        messages = []
        for r, (extra, expected) in zip(rs, invalid):
            assert r.status_code == 400, (extra, r.status_code, r.text)
            msg = _error_message(r)
            assert expected in msg, (extra, msg)
            if expected.startswith("Failed to compile"):
                assert len(msg) > len(expected) + 3, msg  # the backend's reason follows
            messages.append(msg)
        kinds = [m for m, (extra, _) in zip(messages, invalid) if len(extra) == 2]
        for m in kinds:  # names both kinds
            assert "regex" in m and "ebnf" in m, m
        if first is None:
            first = messages
        else:
            assert messages == first  # the same 400 the second time (negative cache)


@pytest.mark.timeout(300)
def test_invalid_constraints_are_400s_xgrammar(server, smollm2_tokenizer):
    _check_invalid_requests(server, smollm2_tokenizer, INVALID)


@pytest.mark.timeout(300)
def test_invalid_constraints_are_400s_llguidance(server_llguidance, smollm2_tokenizer):
    _check_invalid_requests(server_llguidance, smollm2_tokenizer, INVALID[:2])


@pytest.mark.timeout(300)
def test_invalid_constraints_through_openai(server):
    client = _client(server)
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    assert "json_schema is not a valid JSON Schema: " in str(e.value) and "(at #/type)" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, extra_body={"regex": "a(b"})
    assert "Failed to compile regex grammar: " in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                       extra_body={"regex": "[0-9]+", "choice": ["a", "b"]})
    assert "Only one constraint kind per request is allowed" in str(e.value)
