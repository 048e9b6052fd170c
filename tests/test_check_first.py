"""Greedy rows checked against their grammar before any mask (sampling/check_first.py):
``allows_token`` agrees with the filled mask (llguidance: False for EOS, a fill decides) and leaves the matcher as it was, and
ModelRunner.sample gives the mask-first path's tokens, with and without a mask fill, on the
real xgrammar / llguidance libraries with SmolLM2's tokenizer."""
from __future__ import annotations

import concurrent.futures
import json
import types

import pytest
import torch

from constrained.bitmask_ops import allocate_token_bitmask, unpack_bitmask
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.reasoner_grammar_backend import ReasonerGrammarObject
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.req import Req

VOCAB, EOS = 49152, 2
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                     "required": ["n", "s"]})


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer):
    cfg = GrammarBackendConfig(VOCAB, (EOS,), JsonOptions())
    return {"xgrammar": XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, cfg),
            "llguidance": GuidanceBackend.from_tokenizer(smollm2_tokenizer, cfg)}


@pytest.fixture(scope="module")
def native():
    from srt.layers.cpu_kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("gramsync's CPU kernels are not built here (the check runs on their greedy op)")


def mask_of(grammar) -> torch.Tensor:
    buf = allocate_token_bitmask(1, VOCAB)
    grammar.fill_vocab_mask(buf, 0)
    return unpack_bitmask(buf, VOCAB)[0]


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_allows_token_is_the_mask_bit_and_changes_nothing(backends, smollm2_tokenizer, name):
    g = backends[name].init_value(("json_schema", SCHEMA)).copy()
    walk = smollm2_tokenizer.encode('{"n": 12, "s": "hi"}')
    probe = torch.Generator().manual_seed(0)
    for step in range(len(walk) + 1):
        allowed = mask_of(g)
        candidates = torch.randint(0, VOCAB, (200,), generator=probe).tolist()
        candidates += allowed.nonzero().squeeze(1)[:50].tolist() + [EOS]
        for t in candidates:  # llguidance answers False for EOS (a fill then decides)
            if t == EOS and name == "llguidance":
                assert not g.allows_token(t) or allowed[t]
            else:
                assert g.allows_token(t) == bool(allowed[t]), (step, t)
        assert torch.equal(mask_of(g), allowed)  # the checks left the matcher where it was
        if step < len(walk):
            g.accept_token(walk[step])
    assert mask_of(g)[EOS] and g.allows_token(EOS) is (name == "xgrammar")
    g.accept_token(EOS)
    assert g.is_terminated()


def test_a_reasoning_row_allows_everything_until_its_budget(backends, smollm2_tokenizer):
    brace = smollm2_tokenizer.encode("{")[0]
    g = ReasonerGrammarObject(backends["xgrammar"].init_value(("json_schema", SCHEMA)).copy(), think_end_id=7)
    g.maybe_init_reasoning(True, budget=1)
    assert g.allows_token(123) and g.allows_token(7)
    g.accept_token(123)
    assert not g.allows_token(123) and g.allows_token(7)
    g.accept_token(7)
    assert g.allows_token(brace) and not g.allows_token(123) and bool(mask_of(g.grammar)[brace])


def sample(info: SamplingBatchInfo, logits: torch.Tensor, check_first: bool) -> torch.Tensor:
    # ModelRunner.sample needs only these two of the runner (no model is loaded here).
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(logprobs_mode="processed_logprobs"),
                                   sampler=Sampler())
    return ModelRunner.sample(runner, logits, info, (), check_first=check_first)[0]


def batch(backends, name: str, n: int, **params) -> SamplingBatchInfo:
    reqs = []
    for i in range(n):
        r = Req(f"r{i}", (1, 2), SamplingParams(**{"temperature": 0, "max_new_tokens": 8, **params}),
                False, frozenset({EOS}))
        r.grammar = backends[name].init_value(("json_schema", SCHEMA)).copy() if i != 1 else None
        reqs.append(r)
    return SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_sample_gives_the_masked_tokens_with_or_without_a_fill(backends, smollm2_tokenizer, native, name):
    brace = smollm2_tokenizer.encode("{")[0]
    g = torch.Generator().manual_seed(1)
    for case in ("allowed", "rejected"):
        ref, info = batch(backends, name, 3), batch(backends, name, 3)
        logits = torch.randn(3, VOCAB, generator=g)
        if case == "allowed":  # "{" is the only way a JSON object starts here
            logits[:, brace] = 50.0
        want = sample(ref, logits.clone(), check_first=False)
        got = sample(info, logits.clone(), check_first=True)
        assert torch.equal(got, want), case
        assert all(mask_of(info.grammars[i])[got[i]] for i in (0, 2))
        assert info.mask_checked_first is (case == "allowed")
        assert (info.vocab_mask is None) is (case == "allowed")
        assert ref.vocab_mask is not None and not ref.mask_checked_first


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_a_bias_onto_a_forbidden_token_is_masked_after_the_check(backends, smollm2_tokenizer, native, name):
    """logit_bias lifts a token the grammar forbids to the top: the check rejects it, the
    fill masks the already biased logits, and the grammar's best token wins as before."""
    brace, x = smollm2_tokenizer.encode("{")[0], smollm2_tokenizer.encode("x")[0]
    ref = batch(backends, name, 2, logit_bias=((x, 100.0), (brace, 5.0)))
    info = batch(backends, name, 2, logit_bias=((x, 100.0), (brace, 5.0)))
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    want = sample(ref, logits.clone(), check_first=False)
    got = sample(info, logits.clone(), check_first=True)
    assert torch.equal(got, want) and got[0].item() == brace and got[1].item() == x
    assert not info.mask_checked_first and info.vocab_mask is not None


def test_sampled_or_logprob_batches_keep_the_mask_first(backends, native):
    from sampling.check_first import can_check_first

    assert can_check_first(batch(backends, "xgrammar", 2), ())
    assert not can_check_first(batch(backends, "xgrammar", 2), (0,))  # logprobs: the masked distribution
    assert not can_check_first(batch(backends, "xgrammar", 2, temperature=0.7, seed=1), ())
    free = batch(backends, "xgrammar", 2)
    free.grammars = [None, None]
    assert not can_check_first(free, ())  # no grammar: nothing to skip
    started = batch(backends, "xgrammar", 2)
    started.start_vocab_mask_fill(concurrent.futures.ThreadPoolExecutor(1))
    assert not can_check_first(started, ())  # a fill already running beside the forward
