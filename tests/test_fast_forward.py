"""Grammar fast-forward: tokens a grammar forces are appended without a decode step each,
and their KV is computed as extra rows of the next decode step.

Real grammars (xgrammar, llguidance) over SmolLM2's tokenizer, and the real scheduler in
process (fp32, eager): outputs are valid, identical with fast-forward on and off under
greedy decoding, reproducible under seeded sampling, and the KV pool stays consistent.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from constrained.grammar_config import GrammarBackendConfig
from constrained.llguidance_backend import GuidanceBackend
from constrained.reasoner_grammar_backend import ReasonerGrammarObject
from constrained.xgrammar_backend import JumpForwardTokenizer, XGrammarGrammarBackend
from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import TokenizedGenerateReq
from test_scheduler import make_scheduler, run_until_done

VOCAB = 49152
SCHEMA = {"type": "object", "required": ["name", "age", "hobbies"], "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 15}}}}
BACKENDS = {"xgrammar": XGrammarGrammarBackend, "llguidance": GuidanceBackend}


def _grammar(backend: str, tokenizer, schema=SCHEMA):
    eos = (tokenizer.eos_token_id,)
    b = BACKENDS[backend].from_tokenizer(tokenizer, GrammarBackendConfig(VOCAB, eos))
    try:
        return b.dispatch(("json_schema", json.dumps(schema)))
    finally:
        b.shutdown()


def _accept_text(grammar, tokenizer, text: str) -> None:
    for t in tokenizer.encode(text, add_special_tokens=False):
        grammar.accept_token(t)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_forced_key_is_appended_and_accepted(backend, smollm2_tokenizer):
    g = _grammar(backend, smollm2_tokenizer)
    _accept_text(g, smollm2_tokenizer, '{"')
    forced = g.fast_forward(16)
    # The first required key is forced; the closing quote is not (it may merge with ':').
    assert smollm2_tokenizer.decode(forced) == "name", forced
    assert g.fast_forward(16) == []  # the matcher moved past them: nothing forced now
    _accept_text(g, smollm2_tokenizer, '": "Bo", "')  # the forced tokens were really taken
    assert smollm2_tokenizer.decode(g.fast_forward(16)) == "age"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_budget_and_free_choices(backend, smollm2_tokenizer):
    schema = {"type": "object", "required": ["description_of_the_thing"],
              "properties": {"description_of_the_thing": {"type": "string"}}}
    g = _grammar(backend, smollm2_tokenizer, schema)
    assert g.fast_forward(0) == []
    _accept_text(g, smollm2_tokenizer, '{"')
    one = g.fast_forward(1)
    assert len(one) == 1
    rest = g.fast_forward(32)
    assert smollm2_tokenizer.decode(one + rest) == "description_of_the_thing"
    fresh = _grammar(backend, smollm2_tokenizer, {"type": "string"})
    _accept_text(fresh, smollm2_tokenizer, '"')
    assert fresh.fast_forward(8) == []  # free text: a real choice every token


def test_jump_forward_tokenizer_drops_the_boundary_token(smollm2_tokenizer):
    jf = JumpForwardTokenizer(smollm2_tokenizer)
    assert smollm2_tokenizer.decode(jf('facts"')) == "facts"
    assert jf('"') == []  # a single token may merge with what follows: force nothing


def test_no_fast_forward_while_reasoning(smollm2_tokenizer):
    think_end = smollm2_tokenizer.eos_token_id
    g = ReasonerGrammarObject(_grammar("xgrammar", smollm2_tokenizer, {"const": "abcdefgh"}), think_end)
    g.maybe_init_reasoning(True)
    assert g.fast_forward(8) == []
    g.accept_token(think_end)
    assert smollm2_tokenizer.decode(g.fast_forward(8)) in ('"abcdefgh', '"abcdef', '"abcd')


def _requests(tokenizer, tag: str, **params) -> list[TokenizedGenerateReq]:
    out = []
    for i, who in enumerate(["a pirate", "a chef", "a pilot", "a cat"]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {who} as JSON."}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        sp = {"temperature": 0, "max_new_tokens": 120, "json_schema": SCHEMA, **params}
        out.append(TokenizedGenerateReq(f"{tag}{i}", tuple(ids), SamplingParams.from_dict(sp)))
    return out


def _run(smollm2_dir, tokenizer, backend: str, fast_forward: bool, tag: str, **params):
    s = make_scheduler(smollm2_dir, tokenizer, max_total_tokens=4096, max_running_requests=8,
                       grammar_backend=backend, disable_torch_compile=True,
                       disable_grammar_fast_forward=not fast_forward)
    outs = run_until_done(s, {0: _requests(tokenizer, tag, **params)})
    assert not s.has_work()
    s.kv.check_idle_integrity()
    s.grammar_manager.backend.shutdown()
    return s, outs


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_greedy_output_same_with_and_without_fast_forward(backend, smollm2_dir, smollm2_tokenizer):
    plain, off = _run(smollm2_dir, smollm2_tokenizer, backend, False, "off")
    fast, on = _run(smollm2_dir, smollm2_tokenizer, backend, True, "on")
    assert plain.step_stats.fast_forward_tokens == 0 and fast.step_stats.fast_forward_tokens >= 4 * 3  # 3 keys each
    for i in range(4):
        a, b = off[f"off{i}"], on[f"on{i}"]
        assert a["finish"].type == b["finish"].type == "stop"
        assert a["ids"] == b["ids"]
        text = smollm2_tokenizer.decode(b["ids"], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_seeded_sampling_with_fast_forward_is_reproducible(smollm2_dir, smollm2_tokenizer):
    params = {"temperature": 0.9, "seed": 7, "frequency_penalty": 0.3}
    s1, a = _run(smollm2_dir, smollm2_tokenizer, "llguidance", True, "s", **params)
    s2, b = _run(smollm2_dir, smollm2_tokenizer, "llguidance", True, "s", **params)
    assert s1.step_stats.fast_forward_tokens > 0
    assert {k: v["ids"] for k, v in a.items()} == {k: v["ids"] for k, v in b.items()}
    for v in a.values():
        if v["finish"].type == "stop":
            jsonschema.validate(json.loads(smollm2_tokenizer.decode(v["ids"], skip_special_tokens=True)), SCHEMA)


def test_forced_tokens_count_in_penalties_and_positions(smollm2_dir, smollm2_tokenizer):
    from sampling.sampling_batch_info import SamplingBatchInfo
    from srt.scheduler.req import Req

    params = SamplingParams.from_dict({"temperature": 1.0, "frequency_penalty": 1.0, "seed": 1})
    reqs = [Req(f"p{i}", (1, 2, 3), params, False, frozenset({0})) for i in range(2)]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", torch.Generator())
    info.cumulate_output_tokens(torch.tensor([5, 6]))
    info.cumulate_forced_tokens([1, 1, 1], [9, 9, 10])
    assert info.positions == [1, 4]
    logits = torch.zeros(2, VOCAB)
    info.apply_logits_bias(logits)
    assert logits[1, 9] == -2.0 and logits[1, 10] == -1.0 and logits[1, 6] == -1.0
    assert logits[0, 9] == 0.0 and logits[0, 5] == -1.0
