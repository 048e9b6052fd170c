"""Regressions for two defects found by hostile requests:

1. A body nested ~20,000 levels deep (valid JSON) got a bare 500 from every generation
   endpoint: now a 400 in OpenAI's shape, found before any recursive parsing.
2. ``{"$ref": "#"}`` (a schema no document matches) compiled, every mask allowed nothing,
   and the uniform fallback sampled a forbidden token (500 "Grammar rejected ..."): now a
   grammar that admits no output is a 400 on every backend; a grammar that reaches a dead
   end at run time aborts its request with a specific 400; and a masked row never yields
   a token its mask forbids.
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from constrained.bitmask_ops import allocate_token_bitmask
from constrained.json_input import JsonTooDeep, check_json_depth, json_depth
from sampling.sampler import Sampler

pytestmark = pytest.mark.timeout(240)

DEEP = "[" * 20000 + "]" * 20000
SELF_REF = {"$ref": "#"}
# Starts fine ('{"a": '), then the value of "a" is itself: a dead end at run time.
DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}


def _post(base: str, path: str, body) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(base + path, content=data, headers={"content-type": "application/json"},
                      timeout=120)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    return body["error"]["message"]


# ---- 1. deep nesting -------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/generate", '{"text": "Hi", "x": ' + DEEP + '}'),
    ("/v1/completions", '{"model": "m", "prompt": "Hi", "x": ' + DEEP + '}'),
    ("/v1/chat/completions", '{"model": "m", "messages": ' + DEEP + '}'),
    ("/generate", json.dumps({"text": "Hi", "sampling_params": {"json_schema": DEEP}})),
])
def test_deeply_nested_body_is_a_400(server, path, body):
    message = _error(_post(server, path, body), 400)
    assert "nested too deeply" in message and "at most 128" in message, message


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth('{"a": "[[[[{{{{", "b": [1, {"c": "\\"]]"}]}') == 3
    assert json_depth(b"[" * 300 + b"]" * 300) == 300
    check_json_depth('{"s": "' + "[" * 1000 + '"}')  # brackets inside a string: fine
    with pytest.raises(JsonTooDeep, match="129 levels"):
        check_json_depth("[" * 129 + "]" * 129)


# ---- 2. grammars that admit nothing ------------------------------------------------------
def _names_no_output(message: str) -> bool:
    """Our probe's reason, or xgrammar's own (0.2.9 names the circular $ref itself)."""
    return "admits no output" in message or "Circular $ref chain with no schema content: # -> #" in message


@pytest.mark.parametrize("backend", ["server", "server_llguidance", "server_auto"])
def test_self_referencing_schema_is_a_400_on_every_backend(request, backend):
    base = request.getfixturevalue(backend)
    native = _post(base, "/generate", {"text": "JSON:", "sampling_params": {
        "json_schema": SELF_REF, "max_new_tokens": 16}})
    assert _names_no_output(_error(native, 400))
    openai_style = _post(base, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REF}}})
    assert _names_no_output(_error(openai_style, 400))
    ebnf = _post(base, "/generate", {"text": "x", "sampling_params": {
        "ebnf": 'root ::= root "a"', "max_new_tokens": 8}})
    assert "admits no output" in _error(ebnf, 400)


# xgrammar 0.2.9 refuses DEAD_END at compile time (its circular $ref has no content); this
# grammar it compiles, allows "{", and then allows nothing (the rule never ends).
DEAD_END_EBNF = 'root ::= "{" rest\nrest ::= rest "x"'


@pytest.mark.parametrize("backend,kind,spec", [("server", "ebnf", DEAD_END_EBNF),
                                               ("server_llguidance", "json_schema", json.dumps(DEAD_END))])
def test_dead_end_at_run_time_aborts_with_a_specific_400(request, backend, kind, spec):
    base = request.getfixturevalue(backend)
    r = _post(base, "/generate", {"text": "JSON:", "sampling_params": {
        kind: spec, "max_new_tokens": 48, "temperature": 0}})
    message = _error(r, 400)
    assert "cannot be completed" in message, message
    ok = _post(base, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200  # the server is unharmed


def _mask_allowing(vocab: int, allowed: list[int], rows: int = 1) -> torch.Tensor:
    mask = allocate_token_bitmask(rows, vocab)
    mask.zero_()
    for t in allowed:
        mask[:, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return mask


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_masked_row_without_finite_logits_samples_only_allowed_tokens(bad):
    """The uniform fallback of a row with no finite logit stays inside the grammar's mask,
    on the greedy path and the sampling path; unmasked rows keep the whole vocabulary."""
    from sampling.sampling_batch_info import SamplingBatchInfo

    vocab, allowed = 1000, [3, 77, 640]
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        for seed in range(20):
            logits = torch.full((1, vocab), bad)
            info = SamplingBatchInfo.from_reqs([_Req(temperature, seed)], vocab, "cpu",
                                               torch.Generator().manual_seed(seed))
            info.vocab_mask = _mask_allowing(vocab, allowed)
            tok = int(sampler(logits, info)[0])
            assert tok in allowed, (temperature, seed, tok)
    seen = set()
    for seed in range(40):  # no mask: the fallback is uniform over the vocabulary
        info = SamplingBatchInfo.from_reqs([_Req(1.0, seed)], vocab, "cpu",
                                           torch.Generator().manual_seed(seed))
        seen.add(int(sampler(torch.full((1, vocab), float("-inf")), info)[0]))
    assert len(seen) > 30


class _Req:
    """The fields SamplingBatchInfo.from_reqs reads from a request."""

    def __init__(self, temperature: float, seed: int):
        from sampling.sampling_params import SamplingParams

        self.sampling_params = SamplingParams(temperature=temperature, seed=seed)
        self.origin_input_ids = [1, 2]
        self.output_ids = []
        self.stop_ids = frozenset()
        self.grammar = None
