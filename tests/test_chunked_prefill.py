"""Chunked prefill in the real scheduler (the suite's tiny model, fp32): a long prompt is
prefilled in chunks with a decode step for the running requests after each, outputs equal
an unchunked run, a constrained request's grammar sees nothing until its prefill is done,
and an abort mid-prompt frees everything."""
from __future__ import annotations

import dataclasses
import json

import pytest

from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import AbortReq, LogprobRequest, TokenizedGenerateReq
from srt.scheduler.scheduler import resolve_chunk_size
from srt.server_args import ServerArgs
from tests.test_scheduler import make_scheduler, req, run_until_done

LONG = ("A lighthouse keeper kept a log of every ship that passed the rocks, the weather, "
        "the colour of the sea and the birds on the rail. ") * 14  # ~400 tokens
SHORT = ["Count to five:", "Name a fruit:"]


def _modes(sched, arrivals):
    """Run to the end; the mode of every batch and which requests it held."""
    seen = []
    orig = sched.batch_log.record

    def record(mode, rids):
        rids = list(rids)
        seen.append((mode, rids))
        orig(mode, iter(rids))

    sched.batch_log.record = record
    try:
        outs = run_until_done(sched, arrivals)
    finally:
        sched.batch_log.record = orig
    return outs, seen


@pytest.fixture(scope="module")
def chunked(tiny_dir, smollm2_tokenizer):
    return make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=4096,
                          max_running_requests=8, chunked_prefill_size=128, disable_radix_cache=True)


@pytest.fixture(scope="module")
def whole(tiny_dir, smollm2_tokenizer):
    return make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=4096,
                          max_running_requests=8, chunked_prefill_size=-1, disable_radix_cache=True)


def _arrivals(tok, tag, **long_params):
    short = [req(tok, f"{tag}s{i}", p, temperature=0, max_new_tokens=30, ignore_eos=True)
             for i, p in enumerate(SHORT)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, **long_params}
    return {0: short, 3: [req(tok, f"{tag}long", LONG, **params)]}


def test_long_prompt_alternates_with_decodes_and_outputs_match(chunked, whole, smollm2_tokenizer):
    tok = smollm2_tokenizer
    n_long = len(tok(LONG)["input_ids"])
    got, modes = _modes(chunked, _arrivals(tok, "c"))
    want, whole_modes = _modes(whole, _arrivals(tok, "w"))
    for name in ("s0", "s1", "long"):
        assert got[f"c{name}"]["ids"] == want[f"w{name}"]["ids"], name
    long_steps = [i for i, (m, rids) in enumerate(modes) if "clong" in rids and m == "EXTEND"]
    assert len(long_steps) == -(-n_long // 128)  # ceil: every chunk is 128 tokens but the last
    for i in long_steps[:-1]:  # after each chunk, the running requests decode
        assert modes[i + 1][0] == "DECODE" and "cs0" in modes[i + 1][1]
    # Without chunking the whole prompt is one step.
    assert sum(1 for m, rids in whole_modes if "wlong" in rids and m == "EXTEND") == 1


def test_grammar_sees_nothing_until_the_prompt_is_prefilled(chunked, whole, smollm2_tokenizer):
    tok = smollm2_tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = {"max_new_tokens": 20, "temperature": 0, "json_schema": json.dumps(schema)}

    def arrivals(tag):  # a running request, so the long prompt is chunked
        return {0: [req(tok, f"{tag}-run", SHORT[0], temperature=0, max_new_tokens=40, ignore_eos=True)],
                2: [TokenizedGenerateReq(f"{tag}-long", tuple(tok(LONG)["input_ids"]),
                                         SamplingParams.from_dict(params))]}
    got, modes = _modes(chunked, arrivals("g-chunked"))
    want = run_until_done(whole, arrivals("g-whole"))
    assert sum(1 for m, rids in modes if "g-chunked-long" in rids and m == "EXTEND") > 1
    got["g-chunked"], want["g-whole"] = got["g-chunked-long"], want["g-whole-long"]
    assert got["g-chunked"]["ids"] == want["g-whole"]["ids"]
    assert got["g-chunked"]["finish"].type == "stop"
    assert json.loads(tok.decode(got["g-chunked"]["ids"], skip_special_tokens=True))["ok"] in (True, False)


def test_nothing_running_means_no_chunks(chunked, smollm2_tokenizer):
    """Chunks protect running requests' next tokens; with none running the whole prompt is
    one step (scoring and first prefills run in larger, faster steps)."""
    tok = smollm2_tokenizer
    arrivals = {0: [req(tok, "alone", LONG, temperature=0, max_new_tokens=2, ignore_eos=True)]}
    _, modes = _modes(chunked, arrivals)
    assert sum(1 for m, rids in modes if "alone" in rids and m == "EXTEND") == 1


def test_prompt_logprobs_across_chunks_equal_unchunked(chunked, whole, smollm2_tokenizer):
    tok = smollm2_tokenizer
    lp = LogprobRequest(top_n=1, start_len=0)
    outs = {}
    for sched, tag in ((chunked, "c"), (whole, "w")):
        arrivals = _arrivals(tok, tag)
        long_req = arrivals[3][0]
        arrivals[3] = [dataclasses.replace(long_req, logprobs=lp,
                                           sampling_params=dataclasses.replace(long_req.sampling_params,
                                                                               max_new_tokens=0))]
        outs[tag], _ = _modes(sched, arrivals)
    got, want = outs["c"]["clong"], outs["w"]["wlong"]
    assert got["ids"] == [] and len(got["input_logprobs"]) == len(tok(LONG)["input_ids"])
    assert got["input_logprobs"][0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(got["input_logprobs"][1:], want["input_logprobs"][1:]))


def test_abort_mid_prompt_frees_everything(chunked, smollm2_tokenizer):
    tok = smollm2_tokenizer
    arrivals = _arrivals(tok, "a")
    arrivals[5] = [AbortReq("along")]  # the long prompt is still being chunked then
    outs = run_until_done(chunked, arrivals)  # checks idle KV integrity at the end
    assert outs["along"]["finish"].type == "abort" and outs["along"]["ids"] == []
    assert outs["as0"]["finish"].type == "length"


def test_chunk_size_defaults_and_validation():
    assert resolve_chunk_size(None, "cpu") == 256 and resolve_chunk_size(None, "cuda:0") == 8192
    assert resolve_chunk_size(-1, "cpu") is None and resolve_chunk_size(64, "cpu") == 64
    for bad in (0, -2):
        with pytest.raises(ValueError, match="--chunked-prefill-size"):
            ServerArgs(model_path="x", chunked_prefill_size=bad)
