"""CustomLogitProcessor: by-name (de)serialisation, its error messages, the built-in
DisallowedTokensLogitsProcessor, and the frontend checks in prepare_request."""
import json
import pickle

import pytest
import torch

from sampling.custom_logit_processor import (
    CustomLogitProcessor, DisallowedTokensLogitsProcessor, validate_custom_logit_processor,
)
from srt.managers.generate_input import GenerateReqInput, prepare_request
from srt.managers.io_struct import SchedulerInfo

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
