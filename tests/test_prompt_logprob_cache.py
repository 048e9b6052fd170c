"""Prompt logprobs served from the radix cache give the very numbers computing them gives.

Two real engines (scheduler processes) in float32, eager, identical but for
``--disable-prompt-logprob-cache``; the reference is the uncached engine scoring each
prompt alone. Prompts of ~550 tokens over a 256-token prefill budget, so every prompt is
prefilled in chunks. What must hold:
- a cached entry is, to the last bit, the number the engine computed when it first scored
  that position (and the same top alternatives, in order);
- a prompt scored again, or as ``n`` > 1 samples, or several times in one batch, is served
  whole from the cache: bit-identical to the uncached engine scoring it alone;
- a prompt sharing only a context with an earlier one (multiple choice) matches the
  uncached engine within ``TOL``, not to the last bit: the engine itself is not
  batch-invariant. A position's attention depends in its last bits on the length of the
  prompt around it (and on what else shares its chunk), so the same context scored inside
  two prompts differs by up to ~5e-5 without any cache; so does the compiled prefill,
  hence eager here (docs/evaluation.md "Scoring at cache speed").
The TP=2 case is in test_prompt_logprob_cache_tp.py.
"""
from __future__ import annotations

import pytest

from srt.scheduler.prompt_logprob_cache import RECOMPUTE_ROWS

TOL = 1e-4  # fp32: the uncached engine's own spread between batch shapes is ~5e-5

ENGINE_ARGS = dict(max_total_tokens=6144, max_running_requests=8, dtype="float32", random_seed=0,
                   disable_torch_compile=True, max_prefill_tokens=256, chunked_prefill_size=128)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from srt.entrypoints.engine import Engine

    with Engine(model_path=tiny_dir, **ENGINE_ARGS) as on, \
            Engine(model_path=tiny_dir, disable_prompt_logprob_cache=True, **ENGINE_ARGS) as off:
        yield on, off


def _context(tok, topic: str) -> list[int]:
    text = " ".join(f"Fact {i} about {topic}: entry {i * 7 % 13} is filed under shelf {i % 5}."
                    for i in range(36))
    ids = tok(text)["input_ids"]
    assert len(ids) > 512  # more than two prefill chunks
    return ids


def _choices(tok) -> list[list[int]]:
    out = [tok(s, add_special_tokens=False)["input_ids"]
           for s in [" Yes", " The answer is shelf three.", " No, it is somewhere else entirely",
                     " Perhaps shelf four, or maybe shelf two, depending on the entry and the topic"]]
    assert [len(c) for c in out][0] == 1 and len({c[0] for c in out}) == 4
    return out


def _score(engine, prompts, top: int, start: int = 0, params=None) -> list[dict]:
    outs = engine.generate(prompts, params or {"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=start, top_logprobs_num=top)
    return [o["meta_info"] for o in outs]


def _alone(engine, prompts, top: int, start: int = 0) -> list[dict]:
    return [_score(engine, [p], top, start)[0] for p in prompts]


def _same(a: dict, b: dict) -> bool:
    return (a["input_token_logprobs"] == b["input_token_logprobs"]
            and a["input_top_logprobs"] == b["input_top_logprobs"])


def _close(a: dict, b: dict) -> bool:
    """Same tokens, logprobs within TOL, same top ids where no two are within TOL."""
    x, y = a["input_token_logprobs"], b["input_token_logprobs"]
    if [t for _, t, _ in x] != [t for _, t, _ in y] or x[0][0] is not None or y[0][0] is not None:
        return False
    if any(abs(p[0] - q[0]) > TOL for p, q in zip(x[1:], y[1:])):
        return False
    for s, t in zip(a["input_top_logprobs"][1:], b["input_top_logprobs"][1:]):
        if len(s) != len(t) or any(abs(u[0] - v[0]) > TOL for u, v in zip(s, t)):
            return False
    return True


def _prefix_equal(a: dict, b: dict, n: int) -> bool:
    """The first ``n`` prompt entries of two responses are the same numbers."""
    return (a["input_token_logprobs"][:n] == b["input_token_logprobs"][:n]
            and a["input_top_logprobs"][:n] == b["input_top_logprobs"][:n])


def test_a_prompt_scored_again_is_served_whole_and_bit_identical(engines, smollm2_tokenizer):
    on, off = engines
    prompt = _context(smollm2_tokenizer, "apples") + _choices(smollm2_tokenizer)[1]
    first, again = _score(on, [prompt], top=2)[0], _score(on, [prompt], top=2)[0]
    ref = _score(off, [prompt], top=2)[0]
    assert _same(first, ref) and _same(again, ref)
    assert again["cached_tokens"] == len(prompt) - 1 and ref["cached_tokens"] == 0
    # Several requests for it in one batch (not n): one scores it, the rest wait a step.
    many = _score(on, [prompt] * 3, top=1)
    assert all(_same(m, _score(off, [prompt], top=1)[0]) for m in many)


def test_choices_one_after_another_take_the_context_from_the_cache(engines, smollm2_tokenizer):
    on, off = engines
    ctx, choices = _context(smollm2_tokenizer, "pears"), _choices(smollm2_tokenizer)
    outs = []
    for i, c in enumerate(choices):
        a, b = _score(on, [ctx + c], top=2)[0], _score(off, [ctx + c], top=2)[0]
        assert _close(a, b), f"choice {i}"
        assert b["cached_tokens"] == 0  # logprobs from position 0: nothing could be reused
        assert a["cached_tokens"] == (0 if i == 0 else len(ctx) - RECOMPUTE_ROWS)
        outs.append(a)
    served = len(ctx) - RECOMPUTE_ROWS + 1  # entries 0..len(ctx) - RECOMPUTE_ROWS
    assert all(_prefix_equal(a, outs[0], served) for a in outs[1:])


def test_choices_sent_together_reuse_the_first_ones_prefill(engines, smollm2_tokenizer):
    on, off = engines
    ctx, choices = _context(smollm2_tokenizer, "plums"), _choices(smollm2_tokenizer)
    prompts = [ctx + c for c in choices]
    a, b = _score(on, prompts, top=1), _alone(off, prompts, top=1)
    assert all(_close(x, y) for x, y in zip(a, b))
    # One prefills the context; the others wait one step and take it from the cache.
    cached = [x["cached_tokens"] for x in a]
    assert sorted(cached) == [0] + [len(ctx) - RECOMPUTE_ROWS] * 3
    scorer = a[cached.index(0)]
    assert _same(scorer, b[cached.index(0)])
    assert all(_prefix_equal(x, scorer, len(ctx) - RECOMPUTE_ROWS + 1) for x in a)


def test_more_alternatives_than_kept_are_computed_fewer_are_served(engines, smollm2_tokenizer):
    on, off = engines
    ctx, choices = _context(smollm2_tokenizer, "cherries"), _choices(smollm2_tokenizer)
    steps = [(choices[0], 1), (choices[1], 5), (choices[2], 3), (choices[3], 0)]
    outs = []
    for c, top in steps:
        a, b = _score(on, [ctx + c], top=top)[0], _score(off, [ctx + c], top=top)[0]
        assert _close(a, b)
        assert all(len(t) == top for t in a["input_top_logprobs"][1:])
        outs.append(a)
    # Top 1 kept: top 5 computes again (and keeps 5); top 3 and top 0 take theirs.
    assert [a["cached_tokens"] for a in outs] == [0, 0] + [len(ctx) - RECOMPUTE_ROWS] * 2
    served = len(ctx) - RECOMPUTE_ROWS + 1
    for a, top in ((outs[2], 3), (outs[3], 0)):
        assert a["input_token_logprobs"][:served] == outs[1]["input_token_logprobs"][:served]
        assert all(t == u[:top] for t, u in zip(a["input_top_logprobs"][1:served],
                                                 outs[1]["input_top_logprobs"][1:served]))


def test_n_samples_and_a_logprob_start_inside_the_prompt(engines, smollm2_tokenizer):
    on, off = engines
    ctx, choices = _context(smollm2_tokenizer, "grapes"), _choices(smollm2_tokenizer)
    prompt = ctx + choices[2]
    greedy = {"max_new_tokens": 3, "temperature": 0}
    a = on.generate(prompt, {**greedy, "n": 3}, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    b = off.generate(prompt, greedy, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    assert len(a) == 3
    assert all(_same(x["meta_info"], b["meta_info"]) and x["output_ids"] == b["output_ids"] for x in a)
    # The samples after the first take the whole prompt's logprobs from the cache.
    assert sorted(x["meta_info"]["cached_tokens"] for x in a) == [0] + [len(prompt) - 1] * 2
    start = 300  # logprobs from inside the prompt: the cached ones from there on
    prompt = ctx + choices[3]
    x, y = _score(on, [prompt], top=2, start=start)[0], _score(off, [prompt], top=2, start=start)[0]
    assert _close(_lead(x), _lead(y)) and len(x["input_token_logprobs"]) == len(prompt) - start
    assert y["cached_tokens"] == start - 1 and x["cached_tokens"] == len(ctx) - RECOMPUTE_ROWS


def _lead(meta: dict) -> dict:
    """A response from a logprob start > 0, shaped like one from 0 (for ``_close``)."""
    return {"input_token_logprobs": [(None, 0, None)] + meta["input_token_logprobs"],
            "input_top_logprobs": [None] + meta["input_top_logprobs"]}
