"""Pipeline parallelism (``--pp-size``) end to end, with REAL processes on CPU (gloo on
127.0.0.1), at ``--pp-size 2`` and at ``--tp-size 2 --pp-size 2``, float32:

- greedy outputs equal TP=1 (the session's float32 Engine) on concurrent /generate requests
  (their batches are cut into micro-batches), a json_schema request (grammar and
  fast-forward), OpenAI chat with n=2 and a json_schema response_format, a streamed chat,
  completions with logprobs (equal to TP=1 within 1e-4), a prompt longer than a prefill
  chunk (256 tokens on CPU) sent while another request decodes, and that prompt again
  (a radix cache hit, the same output);
- an abort (POST /abort_request) mid-generation leaves the server serving;
- every rank of the DP group (each stage's TP ranks) ran identical batches, with no
  token-agreement mismatch (``GRAMSYNC_BATCH_LOG_DIR``).

A killed rank of either stage is in test_multi_rank_server.py, rank skew and a grammar
failing on one stage in test_grammar_agreement_ranks.py, the running timeout in
test_multi_rank_timeouts.py. The machine may have 2 cores: one module-scoped server per
layout (~20 s and ~35 s to start on 2 cores), short greedy requests (~30 s per layout).
"""
from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from conftest import _launch_server
from test_grammar_agreement_ranks import _identical_batch_logs, _read_log
from test_multi_rank_server import (GREEDY, PERSON_SCHEMA, PROMPTS, _client, _generate, _server_info,
                                    _wait_until, tp1_ids)  # noqa: F401 - tp1_ids: a fixture

LAYOUTS = {  # name: (flags, the DP group's rank names)
    "pp2": (["--pp-size", "2"], ["DP0_PP0_TP0", "DP0_PP1_TP0"]),
    "tp2pp2": (["--tp-size", "2", "--pp-size", "2"],
               ["DP0_PP0_TP0", "DP0_PP0_TP1", "DP0_PP1_TP0", "DP0_PP1_TP1"]),
}
ENTRY = "DP0_PP1_TP0"  # talks to the frontend, samples, broadcasts the ids
# ~420 tokens: two prefill chunks (256 on CPU) when it arrives while another request decodes.
LONG = ("A lighthouse keeper kept a log of every ship that passed the rocks, the weather, "
        "the colour of the sea and the birds on the rail. ") * 15 + "What did the keeper write down?"
CHAT = [{"role": "user", "content": "Describe Alice, who is 30, as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pp_server(request, tmp_path_factory, smollm2_dir):
    """(base, log_dir, ranks) of a float32 server of the layout; every rank logs its batches."""
    flags, ranks = LAYOUTS[request.param]
    log_dir = tmp_path_factory.mktemp(f"{request.param}_batches")
    for base in _launch_server(tmp_path_factory, smollm2_dir, [*flags, "--dtype", "float32"],
                               env={"GRAMSYNC_BATCH_LOG_DIR": str(log_dir)}):
        yield SimpleNamespace(base=base, log_dir=log_dir, ranks=ranks)


@pytest.fixture(scope="module")
def tp1(fp32_engine):
    """``tp1(prompt, return_logprob=False, **sampling_params)``: the TP=1 float32 output (the
    session's Engine) of a prompt, or of chat messages through the chat template as the
    server's chat route renders them; each computed once for both layouts."""
    from srt.tokenizer_utils import apply_chat_template

    cache: dict[str, dict] = {}

    def generate(prompt, return_logprob: bool = False, **params):
        key = json.dumps([prompt, return_logprob, params], sort_keys=True)
        if key not in cache:
            if isinstance(prompt[0], dict):
                prompt = apply_chat_template(fp32_engine.tokenizer, prompt)
            cache[key] = fp32_engine.generate(prompt, params, return_logprob=return_logprob)
        return cache[key]

    return generate


def _rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _entry_log(s) -> list[str]:
    """The entry rank's (the last stage's TP rank 0) batch log lines."""
    return _read_log(s.log_dir / f"batches_{ENTRY}.log")


def _batches_of(s, rid: str) -> list[str]:
    """The modes of the batches (on the entry rank) that held ``rid``."""
    return [mode for _, mode, rids in (ln.split(" ", 2) for ln in _entry_log(s)) if rid in rids.split(",")]


@pytest.mark.timeout(300)  # includes starting the module's server (~30-60 s, up to 150 s)
def test_concurrent_generate_equals_tp1(pp_server, tp1_ids):
    """Six prompts at once: batched together, each batch cut into micro-batches."""
    prefix = _rid("pp-greedy")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda i: _generate(pp_server.base, PROMPTS[i], rid=f"{prefix}-{i}", **GREEDY),
                             range(len(PROMPTS))))
    for prompt, want, out in zip(PROMPTS, tp1_ids, outs):
        assert out["output_ids"] == want, f"PP differs from TP=1 for {prompt!r}"
    mine = {f"{prefix}-{i}" for i in range(len(PROMPTS))}
    widest = max(len(mine & set(ln.split(" ", 2)[2].split(","))) for ln in _entry_log(pp_server))
    assert widest >= 2, "the requests never shared a batch"


@pytest.mark.timeout(120)
def test_json_schema_with_fast_forward_equals_tp1(pp_server, tp1):
    prompt, params = "Describe Alice, who is 30, as JSON:", {
        "json_schema": json.dumps(PERSON_SCHEMA), "max_new_tokens": 64, "temperature": 0}
    want = tp1(prompt, **params)
    rid = _rid("pp-json")
    got = _generate(pp_server.base, prompt, rid=rid, **params)
    assert got["meta_info"]["finish_reason"]["type"] == "stop", got
    jsonschema.validate(json.loads(got["text"]), PERSON_SCHEMA)
    assert got["output_ids"] == want["output_ids"]
    # Both fast-forward, but not the same count: the TP=1 reference speculates (auto, the
    # default) and takes some forced tokens inside its drafts; PP does not speculate.
    assert got["meta_info"]["fast_forward_tokens"] > 0 and want["meta_info"]["fast_forward_tokens"] > 0
    assert any(" FORCED " in ln for ln in _entry_log(pp_server))


@pytest.mark.timeout(120)
def test_openai_chat_n2_json_and_stream_equal_tp1(pp_server, tp1):
    from srt.entrypoints.openai_protocol import response_format_constraint

    client = _client(pp_server.base)
    kind, spec = response_format_constraint(RESPONSE_FORMAT)  # as the chat route maps it
    want = tp1(CHAT, **{kind: spec, "n": 2, "max_new_tokens": 64, "temperature": 0})
    r = client.chat.completions.create(model="smollm2", messages=CHAT, n=2, max_tokens=64, temperature=0,
                                       response_format=RESPONSE_FORMAT)
    assert [c.message.content for c in r.choices] == [w["text"] for w in want]
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON_SCHEMA)

    hello = [{"role": "user", "content": "Say hello in one sentence."}]
    want = tp1(hello, max_new_tokens=16, temperature=0)
    text = "".join(ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
        model="smollm2", messages=hello, max_tokens=16, temperature=0, stream=True) if ev.choices)
    assert text == want["text"]


@pytest.mark.timeout(120)
def test_completions_logprobs_equal_tp1(pp_server, tp1):
    """Logprobs come from the last stage's logits (the entry rank holds them)."""
    prompt = "The capital of France is"
    want = tp1(prompt, return_logprob=True, max_new_tokens=8, temperature=0)
    r = _client(pp_server.base).completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                                   temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want["text"]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.token_logprobs == pytest.approx([e[0] for e in want["meta_info"]["output_token_logprobs"]],
                                              abs=1e-4)


@pytest.mark.timeout(180)
def test_long_prompt_chunked_then_cached_equals_tp1(pp_server, tp1):
    """A prompt over the chunk size, arriving while another request decodes: prefilled in
    chunks (each cut into micro-batches, the second part of a cut a continuation); then the
    same prompt again, from the radix cache. Both equal TP=1."""
    params = {"max_new_tokens": 8, "temperature": 0}
    want = tp1(LONG, **params)
    assert want["meta_info"]["prompt_tokens"] > 300
    busy, first_token = _rid("pp-busy"), threading.Event()

    def decode_meanwhile():
        body = {"text": "Tell me a long story.", "rid": busy, "stream": True,
                "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}}
        with httpx.stream("POST", pp_server.base + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first_token.set()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(decode_meanwhile)
        assert first_token.wait(60), "the busy request produced no token"
        rid = _rid("pp-long")
        first = _generate(pp_server.base, LONG, rid=rid, **params)
        running.result()
    again = _generate(pp_server.base, LONG, rid=rid + "-again", **params)
    assert first["output_ids"] == again["output_ids"] == want["output_ids"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 300
    assert len([m for m in _batches_of(pp_server, rid) if m in ("EXTEND", "MIXED")]) >= 2, \
        "the long prompt was not prefilled in chunks"


@pytest.mark.timeout(120)
def test_abort_mid_generation_keeps_serving(pp_server):
    """An administrator's abort reaches every stage in the same step (the request broadcast
    spans the DP group): the request stops, the server serves on."""
    base, rid = pp_server.base, _rid("pp-abort")
    body = {"text": "Write a very long essay about the sea.", "rid": rid,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, base + "/generate", json=body, timeout=120)
        _wait_until(lambda: _batches_of(pp_server, rid).count("DECODE") >= 3, 60, f"{rid} to decode")
        r = httpx.post(base + "/abort_request", json={"rid": rid}, timeout=10)
        assert r.status_code == 200 and r.json() == {"aborted": [rid]}, r.text
        res = fut.result()
    assert res.status_code == 200, res.text  # SGLang's answer: the partial output, finish reason abort
    fr = res.json()["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "aborted by an administrator" in fr["message"], res.text
    assert 0 < res.json()["meta_info"]["completion_tokens"] < 1000
    _wait_until(lambda: _server_info(base)["num_inflight_requests"] == 0, 20, "the abort to settle")
    ran = len(_batches_of(pp_server, rid))
    after = _rid("pp-after-abort")
    assert _generate(base, "Hi", rid=after, max_new_tokens=4, temperature=0)["meta_info"]["completion_tokens"] == 4
    assert ran < 500 and len(_batches_of(pp_server, rid)) == ran, "the aborted request still ran"
    assert _batches_of(pp_server, after)


@pytest.mark.timeout(120)
def test_every_rank_ran_the_same_batches(pp_server):
    """Last in the module: every stage's TP ranks wrote identical batch logs (batches,
    forced tokens, radix digests) and the ids every rank took from the last stage never
    differed from its own sample (AGREE 0, asserted by ``_identical_batch_logs``)."""
    rid = _rid("pp-final")
    out = _generate(pp_server.base, "My phone number is ", rid=rid, regex=r"[0-9]{3}-[0-9]{4}",
                    max_new_tokens=16, temperature=0)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    batches = _identical_batch_logs(pp_server.log_dir, ranks=pp_server.ranks)
    assert rid in {r for _, _, rids in batches for r in rids}
    agreed = [ln for ln in _entry_log(pp_server) if " AGREE " in ln]
    assert agreed, "no batch with a grammar went through the sampled-ids broadcast"
