"""CustomLogitProcessor: by-name (de)serialisation, its error messages, the built-in
DisallowedTokensLogitsProcessor, the frontend checks in prepare_request, and that a
processor cannot lift the grammar mask (real grammars; a real server)."""
import json
import pickle

import httpx
import jsonschema
import pytest
import torch

from constrained.bitmask_ops import unpack_bitmask
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.custom_logit_processor import (
    CustomLogitProcessor, DisallowedTokensLogitsProcessor, validate_custom_logit_processor,
)
from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.frontend.generate_input import GenerateReqInput, prepare_request
from srt.transport.io_struct import SchedulerInfo
from srt.scheduler.req import Req

INFO = SchedulerInfo(max_total_num_tokens=4096, max_running_requests=8, context_len=8192,
                     vocab_size=10, eos_token_ids=(2,))
DISALLOW = DisallowedTokensLogitsProcessor.to_str()


class AddDelta(CustomLogitProcessor):
    """Test processor: adds custom_params["delta"] to every logit of its rows."""

    def __call__(self, logits, custom_param_list):
        for i, p in enumerate(custom_param_list):
            if p is not None:
                logits[i] += p["delta"]
        return logits


class BoostTokens(CustomLogitProcessor):
    """Test processor: custom_params["token_ids"] get logit +1e4 (tokens a grammar forbids)."""

    def __call__(self, logits, custom_param_list):
        for i, p in enumerate(custom_param_list):
            if p is not None:
                logits[i, p["token_ids"]] = 1e4
        return logits


class Outer:
    class Inner(AddDelta):
        pass


class NeedsArgs(AddDelta):
    def __init__(self, x):
        self.x = x


def test_builtin_round_trip_and_cache():
    assert json.loads(DISALLOW) == {"callable": "sampling.custom_logit_processor:DisallowedTokensLogitsProcessor"}
    proc = CustomLogitProcessor.from_str(DISALLOW)
    assert type(proc) is DisallowedTokensLogitsProcessor
    assert CustomLogitProcessor.from_str(DISALLOW) is proc  # one instance per string


@pytest.mark.parametrize("cls", [AddDelta, Outer.Inner])
def test_subclass_in_another_module_round_trips(cls):
    s = cls.to_str()
    assert json.loads(s)["callable"].endswith(":" + cls.__qualname__)
    proc = CustomLogitProcessor.from_str(s)
    assert type(proc) is cls
    out = proc(torch.zeros(2, 3), [{"delta": 1.5}, None])
    assert out.tolist() == [[1.5] * 3, [0.0] * 3]


def test_to_str_refuses_classes_the_server_cannot_import():
    class Local(AddDelta):
        pass
    with pytest.raises(ValueError, match="module level"):
        Local.to_str()


@pytest.mark.parametrize("s,msg", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", 'must be a JSON object with a "callable" key'),
    ('{"function": "a:B"}', 'must be a JSON object with a "callable" key'),
    ('{"callable": 5}', 'must be a JSON object with a "callable" key'),
    ('{"callable": "just_a_module"}', 'must look like "package.module:ClassName"'),
    ('{"callable": "no_such_module_gramsync:X"}', "cannot import module 'no_such_module_gramsync'"),
    ('{"callable": "sampling.custom_logit_processor:Nope"}', "has no attribute 'Nope'"),
    ('{"callable": "json:JSONDecoder"}', "is not a subclass of CustomLogitProcessor"),
    ('{"callable": "json:dumps"}', "is not a subclass of CustomLogitProcessor"),
    ('{"callable": "sampling.custom_logit_processor:CustomLogitProcessor"}', "cannot be instantiated"),
    (json.dumps({"callable": f"{__name__}:NeedsArgs"}), "cannot be instantiated with no arguments"),
    (None, "must be a string"),
])
def test_from_str_errors(s, msg):
    with pytest.raises(ValueError) as e:
        CustomLogitProcessor.from_str(s)
    assert msg in str(e.value)


def test_disallowed_tokens_sets_exactly_those_ids_to_minus_inf():
    logits = torch.randn(4, 10)
    before = logits.clone()
    params = [{"token_ids": [1, 4]}, None, {"token_ids": []}, {"token_ids": [9, 0]}]
    out = CustomLogitProcessor.from_str(DISALLOW)(logits, params)
    expected = before.clone()
    expected[0, [1, 4]] = float("-inf")
    expected[3, [0, 9]] = float("-inf")
    assert torch.equal(out, expected)
    out = DisallowedTokensLogitsProcessor()(before.clone(), [None] * 4)
    assert torch.equal(out, before)


@pytest.mark.parametrize("params", [{"token_ids": [1.5]}, {"token_ids": ["3"]}, {"token_ids": [True]},
                                    {"token_ids": 3}, {"ids": [1]}])
def test_disallowed_tokens_rejects_non_integer_ids(params):
    with pytest.raises(ValueError, match="token_ids"):
        DisallowedTokensLogitsProcessor()(torch.zeros(1, 10), [params])
    with pytest.raises(ValueError, match="token_ids"):
        validate_custom_logit_processor(DISALLOW, params, 10)


def test_validate_checks_the_vocab_range():
    assert isinstance(validate_custom_logit_processor(DISALLOW, {"token_ids": [0, 9]}, 10),
                      DisallowedTokensLogitsProcessor)
    validate_custom_logit_processor(DISALLOW, None, 10)
    validate_custom_logit_processor(AddDelta.to_str(), {"anything": 1}, 10)  # default hook: no checks
    for bad in (10, -1):
        with pytest.raises(ValueError, match=rf"must be in \[0, 10\), got {bad}"):
            validate_custom_logit_processor(DISALLOW, {"token_ids": [3, bad]}, 10)


def _prepare(enable=True, **kw):
    return prepare_request(GenerateReqInput(input_ids=[1, 2], **kw), None, INFO,
                           enable_custom_logit_processor=enable)


def test_prepare_request_moves_the_processor_into_sampling_params():
    req = _prepare(custom_logit_processor=DISALLOW, sampling_params={"custom_params": {"token_ids": [3]}})
    assert req.sampling_params.custom_logit_processor == DISALLOW
    assert req.sampling_params.custom_params == {"token_ids": [3]}
    assert pickle.loads(pickle.dumps(req)) == req  # crosses the process boundary
    # Also accepted inside sampling_params (the same string twice is fine).
    req = _prepare(custom_logit_processor=DISALLOW, sampling_params={"custom_logit_processor": DISALLOW})
    assert req.sampling_params.custom_logit_processor == DISALLOW


def test_prepare_request_rejections():
    for kw in ({"custom_logit_processor": DISALLOW},
               {"sampling_params": {"custom_logit_processor": DISALLOW}}):
        with pytest.raises(ValueError, match="start it with --enable-custom-logit-processor"):
            _prepare(enable=False, **kw)
    with pytest.raises(ValueError, match="given twice"):
        _prepare(custom_logit_processor=DISALLOW, sampling_params={"custom_logit_processor": AddDelta.to_str()})
    with pytest.raises(ValueError, match="custom_params token_ids must be in"):
        _prepare(custom_logit_processor=DISALLOW, sampling_params={"custom_params": {"token_ids": [10]}})
    with pytest.raises(ValueError, match="cannot import module"):
        _prepare(custom_logit_processor='{"callable": "no_such_module_gramsync:X"}')
    with pytest.raises(ValueError, match="custom_logit_processor must be a str"):
        GenerateReqInput.from_dict({"text": "a", "custom_logit_processor": {"callable": "a:B"}})


@pytest.mark.parametrize("kind,spec", [("json_schema", {"type": "object"}), ("regex", "a+"),
                                       ("ebnf", "root ::= 'a'"), ("choice", ["a", "b"])])
def test_constraints_pass_to_the_scheduler_next_to_a_processor(kind, spec):
    req = _prepare(custom_logit_processor=DISALLOW,
                   sampling_params={kind: spec, "custom_params": {"token_ids": [1]}})
    assert req.sampling_params.constraint[0] == kind
    assert req.sampling_params.custom_logit_processor == DISALLOW


# ---- a processor cannot lift the grammar mask (penalties -> processors -> mask -> bias) ----
SMOL_VOCAB, SMOL_EOS, HELLO = 49152, (2,), 19556  # "Hello" in SmolLM2's vocabulary
# "Hello" fits nowhere in these: the grammar forbids it at every step.
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
BACKENDS = {"xgrammar": XGrammarGrammarBackend, "llguidance": GuidanceBackend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_processor_boost_cannot_lift_the_grammar_mask(backend, smollm2_tokenizer):
    """Rows 0 (greedy) and 1 (seeded, plus a +100 logit bias) are constrained, row 2 is not:
    every processor boosts "Hello" to +1e4; only the free row may sample it."""
    assert smollm2_tokenizer.convert_tokens_to_ids("Hello") == HELLO
    compiler = BACKENDS[backend].from_tokenizer(
        smollm2_tokenizer, GrammarBackendConfig(SMOL_VOCAB, SMOL_EOS, JsonOptions()))
    boost = {"custom_logit_processor": BoostTokens.to_str(), "custom_params": {"token_ids": [HELLO]}}
    params = [dict(temperature=0), dict(temperature=1.0, seed=3, logit_bias=((HELLO, 100.0),)),
              dict(temperature=0)]
    reqs = [Req(f"r{i}", (1, 2), SamplingParams(max_new_tokens=32, **p, **boost), False,
                frozenset(SMOL_EOS)) for i, p in enumerate(params)]
    for r in reqs[:2]:
        r.grammar = compiler.dispatch(("json_schema", json.dumps(ANSWER)))
    info = SamplingBatchInfo.from_reqs(reqs, SMOL_VOCAB, "cpu", torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    texts = ["", ""]
    for _ in range(24):
        logits = torch.randn(3, SMOL_VOCAB, generator=g) * 4
        info.update_regex_vocab_mask()
        allowed = unpack_bitmask(info.vocab_mask, SMOL_VOCAB)
        info.apply_logits_bias(logits)
        assert logits[:2, HELLO].tolist() == [float("-inf")] * 2 and logits[2, HELLO] == 1e4
        ids = Sampler()(logits, info).tolist()
        assert not info.take_failed_rows()
        assert ids[2] == HELLO  # the processor really ran
        for i in (0, 1):
            assert allowed[i, ids[i]] and ids[i] != HELLO, (i, ids[i])
            reqs[i].grammar.accept_token(ids[i])  # raises on a token the grammar rejects
            texts[i] += smollm2_tokenizer.decode([ids[i]])
        info.cumulate_output_tokens(torch.tensor(ids))
        if any(r.grammar.is_terminated() for r in reqs[:2]):
            break
    assert all(t.lstrip().startswith("{") for t in texts), texts


# The server imports the class by this name: it runs from the repository root, where
# tests/ is a namespace package (in this process the module is test_custom_logit_processor).
SERVER_BOOST = json.dumps({"callable": "tests.test_custom_logit_processor:BoostTokens"})


@pytest.mark.parametrize("kind,spec", [("json_schema", json.dumps(ANSWER)), ("regex", "(yes|no)")])
def test_server_processor_boost_keeps_the_constraint(server, kind, spec):
    """--enable-custom-logit-processor server: a processor boosting a token the constraint
    forbids gives HTTP 200 and a valid document (it used to end in a 500)."""
    def generate(**constraint):
        body = {"text": "Answer with a number.", "custom_logit_processor": SERVER_BOOST,
                "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                    "custom_params": {"token_ids": [HELLO]}, **constraint}}
        return httpx.post(server + "/generate", json=body, timeout=120)

    free = generate()
    assert free.status_code == 200, free.text
    assert free.json()["text"].startswith("HelloHello")  # the server runs the processor
    r = generate(**{kind: spec})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    if kind == "json_schema":
        jsonschema.validate(json.loads(out["text"]), ANSWER)
    else:
        assert out["text"] in ("yes", "no")
