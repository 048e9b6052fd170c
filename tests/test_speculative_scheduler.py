"""Speculative decoding through the real scheduler in process (SmolLM2, fp32, eager): the
outputs with --speculative-algorithm NGRAM are the outputs without it.

Greedy tokens are identical (JSON extraction under both grammar libraries, a rewrite, n > 1
samples, stop strings, max_new_tokens), seeded sampling gives the very same tokens (with
penalties, logit bias and min_new_tokens: every verified row sees the state its position
would have), logprobs are the same numbers, an abort while drafts are pending loses
nothing, and the KV pool and the radix cache hold only accepted tokens
(``run_until_done`` checks the pool after every run)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import AbortReq, LogprobRequest, TokenizedGenerateReq
from spec_workloads import extraction_messages, extraction_schema, rewrite_messages
from test_scheduler import make_scheduler


def _ids(tok, messages) -> tuple[int, ...]:
    return tuple(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False))


def _run(model_dir, tok, spec: bool, msgs_at: dict[int, list], backend="xgrammar", abort_at=None):
    """Step to the end; per rid: output ids, finish reason, logprobs, and the scheduler."""
    s = make_scheduler(model_dir, tok, max_total_tokens=4096, max_running_requests=8,
                       grammar_backend=backend, disable_torch_compile=True,
                       speculative_algorithm="NGRAM" if spec else None)
    outs: dict[str, dict] = {}
    step = 0
    while s.has_work() or any(k >= step for k in msgs_at):
        msgs = list(msgs_at.get(step, []))
        if abort_at and step >= abort_at[0] and abort_at[1] in s.reqs and any(
                r.rid == abort_at[1] and r.draft_ids for r in s.running):
            msgs.append(AbortReq(abort_at[1]))  # while it holds drafts
            abort_at = None
        s.process_input_requests(msgs)
        for batch in s.step():
            for i, rid in enumerate(batch.rids):
                o = outs.setdefault(rid, {"ids": [], "lps": []})
                o["ids"].extend(batch.new_token_ids[i])
                o["finish"] = batch.finished_reasons[i]
                if batch.output_logprobs and batch.output_logprobs[i] is not None:
                    o["lps"].extend(batch.output_logprobs[i].token_logprobs)
                if batch.spec_verify_ct:
                    o["verify_ct"] = batch.spec_verify_ct[i]
        step += 1
        assert step < 3000
    assert not s.has_work()
    s.kv.check_idle_integrity()
    s.grammar_manager.backend.shutdown()
    return outs, s


def _extraction(tok, tag, **params):
    return [TokenizedGenerateReq(f"{tag}{i}", _ids(tok, extraction_messages(i)), SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 120, "json_schema": extraction_schema(i), **params}))
        for i in range(2)]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_greedy_extraction_identical_and_drafts_accepted(backend, smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    off, _ = _run(smollm2_dir, tok, False, {0: _extraction(tok, "e")}, backend)
    on, s = _run(smollm2_dir, tok, True, {0: _extraction(tok, "e")}, backend)
    for rid in off:
        assert on[rid]["ids"] == off[rid]["ids"], rid
        assert on[rid]["finish"].type == off[rid]["finish"].type
        if on[rid]["finish"].type == "stop":
            text = tok.decode(on[rid]["ids"], skip_special_tokens=True)
            jsonschema.validate(json.loads(text), extraction_schema(int(rid[-1])))
        # fewer decode steps than tokens: drafts were accepted
        assert on[rid]["verify_ct"] < len(on[rid]["ids"]) - 1
    st = s.step_stats
    assert st.spec_accepted_tokens >= 10 and st.spec_verify_steps > 0


def test_greedy_rewrite_n_samples_stops_and_lengths(smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = _ids(tok, rewrite_messages())

    def reqs():
        return [TokenizedGenerateReq("long", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 70})),
                TokenizedGenerateReq("cut", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 9})),
                TokenizedGenerateReq("stop", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 70,
                                                                            "stop": ["keeper"]})),
                *[TokenizedGenerateReq(f"n{k}", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 40}),
                                       prefix_group="g") for k in range(2)]]
    off, _ = _run(smollm2_dir, tok, False, {0: reqs()})
    on, s = _run(smollm2_dir, tok, True, {0: reqs()})
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    assert len(on["cut"]["ids"]) == 9 and on["cut"]["finish"].type == "length"
    assert on["stop"]["finish"].type == "stop" and on["stop"]["finish"].matched == "keeper"
    assert s.step_stats.spec_accepted_tokens >= 20
    # The cache holds prompt + outputs, never a rejected draft: each cached sequence is
    # the prompt plus a prefix of an output that was returned.
    kept = {tuple(ids) + tuple(v["ids"]) for v in on.values()}
    for seq in _tree_leaves(s.kv.tree):
        assert any(k[:len(seq)] == seq for k in kept), "a cached sequence was never output"


def _tree_leaves(tree):
    """Every root-to-leaf token sequence of the radix tree."""
    out, stack = [], [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        kids = list(node.children.values())
        if not kids and prefix:
            out.append(prefix)
        stack += [(c, prefix + tuple(c.key)) for c in kids]
    return out


def test_seeded_sampling_with_penalties_gives_the_same_tokens(smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 5, "frequency_penalty": 0.2,
              "presence_penalty": 0.1, "repetition_penalty": 1.05, "min_new_tokens": 20,
              "logit_bias": {str(tok.encode(" tower")[0]): 1.5}}

    def reqs():
        return [TokenizedGenerateReq("rw", _ids(tok, rewrite_messages()),
                                     SamplingParams.from_dict({"max_new_tokens": 60, **params})),
                *_extraction(tok, "x", seed=9, temperature=0.7, frequency_penalty=0.3)]
    off, _ = _run(smollm2_dir, tok, False, {0: reqs()}, "llguidance")
    on, s = _run(smollm2_dir, tok, True, {0: reqs()}, "llguidance")
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    assert s.step_stats.spec_accepted_tokens > 0


def test_logprobs_are_the_same_numbers(smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer

    def reqs():
        return [TokenizedGenerateReq(f"lp{i}", _ids(tok, extraction_messages(i)), SamplingParams.from_dict(
            {"temperature": 0, "max_new_tokens": 60, "json_schema": extraction_schema(i)}),
            logprobs=LogprobRequest(top_n=2)) for i in range(2)]
    off, _ = _run(smollm2_dir, tok, False, {0: reqs()})
    on, s = _run(smollm2_dir, tok, True, {0: reqs()})
    for rid in off:
        assert on[rid]["ids"] == off[rid]["ids"]
        assert len(on[rid]["lps"]) == len(on[rid]["ids"])
        assert on[rid]["lps"] == pytest.approx(off[rid]["lps"], abs=1e-5)
    assert s.step_stats.spec_accepted_tokens > 0


def test_abort_while_drafts_are_pending(smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    outs, s = _run(smollm2_dir, tok, True, {0: _extraction(tok, "a")}, abort_at=(3, "a0"))
    assert outs["a0"]["finish"].type == "abort"
    assert outs["a1"]["finish"].type in ("stop", "length")  # the other request is untouched
    # _run checked that the pool is whole again: the drafts' slots were never leaked
