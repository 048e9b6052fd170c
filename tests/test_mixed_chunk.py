"""Mixed chunks (--enable-mixed-chunk) in the real scheduler (the suite's tiny model, fp32): a
prefill chunk and the running requests' decode rows share one forward, and every request
gets the tokens, logprobs, grammar outputs and finish reasons it gets without mixing.
TP=2 lock-step with mixed steps: test_grammar_agreement_ranks.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import AbortReq, LogprobRequest, TokenizedGenerateReq
from tests.test_chunked_prefill import LONG, SHORT, _modes
from tests.test_scheduler import make_scheduler, req, run_until_done

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def _scheduler(dir_, tok, mixed: bool, **kw):
    kw = {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": 128,
          "disable_radix_cache": True, **kw}
    return make_scheduler(dir_, tok, enable_mixed_chunk=mixed, **kw)


@pytest.fixture(scope="module")
def mixed(tiny_dir, smollm2_tokenizer):
    return _scheduler(tiny_dir, smollm2_tokenizer, True)


@pytest.fixture(scope="module")
def alternating(tiny_dir, smollm2_tokenizer):
    return _scheduler(tiny_dir, smollm2_tokenizer, False)


def _json_req(tok, rid, prompt, **params):
    p = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA), **params}
    return TokenizedGenerateReq(rid, tuple(tok(prompt)["input_ids"]), SamplingParams.from_dict(p))


def _arrivals(tok, tag):
    """Short requests decode (greedy, seeded sampling, a JSON schema with fast-forward, output
    logprobs) while a long prompt, then a constrained long prompt, arrive and are chunked."""
    lp = LogprobRequest(top_n=2, start_len=-1)
    return {
        0: [req(tok, f"{tag}-greedy", SHORT[0], temperature=0, max_new_tokens=40, ignore_eos=True),
            req(tok, f"{tag}-seeded", SHORT[1], temperature=0.9, top_p=0.9, seed=11,
                max_new_tokens=40, ignore_eos=True),
            _json_req(tok, f"{tag}-json", "Describe a cat as JSON:"),
            dataclasses.replace(req(tok, f"{tag}-lp", SHORT[1], temperature=0, max_new_tokens=30,
                                    ignore_eos=True), logprobs=lp)],
        3: [req(tok, f"{tag}-long", LONG, temperature=0, max_new_tokens=8, ignore_eos=True)],
        4: [_json_req(tok, f"{tag}-longjson", LONG + " Now describe a dog as JSON:")],
    }


def _run(sched, tok, tag):
    outs, modes = _modes(sched, _arrivals(tok, tag))
    return {k.split("-", 1)[1]: v for k, v in outs.items()}, modes


def test_outputs_equal_alternating_chunks(mixed, alternating, smollm2_tokenizer):
    tok = smollm2_tokenizer
    got, modes = _run(mixed, tok, "m")
    want, alt_modes = _run(alternating, tok, "a")
    assert got.keys() == want.keys()
    for name in got:
        assert got[name]["ids"] == want[name]["ids"], name
        assert got[name]["finish"].type == want[name]["finish"].type, name
    for name in ("json", "longjson"):  # the grammar held on both sides of a mixed step
        assert got[name]["finish"].type == "stop"
        doc = json.loads(tok.decode(got[name]["ids"], skip_special_tokens=True))
        assert set(doc) == {"name", "ok"}
    # The long prompts were chunked in mixed steps, each carrying the running requests:
    # no decode-only step between two chunks, and fewer steps than alternating.
    mixed_steps = [rids for m, rids in modes if m == "MIXED"]
    assert len(mixed_steps) >= 6, [m for m, _ in modes]
    assert any("m-long" in rids and "m-greedy" in rids and "m-json" in rids for rids in mixed_steps)
    assert "MIXED" not in {m for m, _ in alt_modes}
    assert len(modes) < len(alt_modes)


def test_logprobs_in_both_parts_equal_alternating(mixed, alternating, smollm2_tokenizer):
    """Output logprobs of a decoding request and prompt logprobs of a prompt chunked in
    mixed steps are the numbers an alternating run computes."""
    tok = smollm2_tokenizer
    outs = {}
    for sched, tag in ((mixed, "m"), (alternating, "a")):
        arrivals = _arrivals(tok, tag)
        arrivals[3] = [dataclasses.replace(arrivals[3][0], logprobs=LogprobRequest(top_n=1, start_len=0))]
        outs[tag], _ = _modes(sched, arrivals)
    got, want = outs["m"]["m-long"], outs["a"]["a-long"]
    assert len(got["input_logprobs"]) == len(tok(LONG)["input_ids"]) and got["input_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(got["input_logprobs"][1:], want["input_logprobs"][1:])) < 1e-4
    assert outs["m"]["m-lp"]["ids"] == outs["a"]["a-lp"]["ids"]


def test_abort_mid_prompt_in_a_mixed_step_frees_everything(mixed, smollm2_tokenizer):
    tok = smollm2_tokenizer
    arrivals = _arrivals(tok, "x")
    arrivals[6] = [AbortReq("x-long"), AbortReq("x-json")]  # one chunking, one decoding
    outs, modes = _modes(mixed, arrivals)  # run_until_done checks KV integrity when idle
    assert outs["x-long"]["finish"].type == "abort" and outs["x-long"]["ids"] == []
    assert outs["x-json"]["finish"].type == "abort"
    assert outs["x-greedy"]["finish"].type == "length" and len(outs["x-greedy"]["ids"]) == 40
    assert "MIXED" in {m for m, _ in modes}


def test_tight_kv_pool_outputs_equal_a_roomy_one(tiny_dir, smollm2_tokenizer):
    """A pool too small for the long prompt next to the running requests' reservations: it
    waits, mixes in once they leave room, and every output equals a roomy run's."""
    tok = smollm2_tokenizer
    tight = _scheduler(tiny_dir, tok, True, max_total_tokens=560, max_running_requests=4)
    roomy = _scheduler(tiny_dir, tok, True, max_total_tokens=4096, max_running_requests=4)

    def arrivals(tag):
        return {0: [req(tok, f"{tag}{i}", SHORT[i % 2], temperature=0, max_new_tokens=20 + 30 * i,
                        ignore_eos=True) for i in range(3)],
                2: [req(tok, f"{tag}long", LONG, temperature=0, max_new_tokens=4, ignore_eos=True)]}
    got, tight_modes = _modes(tight, arrivals("t"))
    want, roomy_modes = _modes(roomy, arrivals("r"))
    for name in ("0", "1", "2", "long"):
        assert got[f"t{name}"]["ids"] == want[f"r{name}"]["ids"], name
    first_long = [next(i for i, (m, rids) in enumerate(ms) if f"{tag}long" in rids)
                  for ms, tag in ((tight_modes, "t"), (roomy_modes, "r"))]
    assert first_long[0] > first_long[1]  # it waited for room
