"""Prompt logprobs from the radix cache at TP=2, through the real server's lm-eval path
(``/v1/completions`` with ``echo``, ``max_tokens: 0``, ``logprobs``).

Only the entry rank holds the cached numbers; the other rank holds their counts, and both
must lock the same prefixes: their batch logs (with tree digests) must be identical line
for line. Against a TP=2 server without the cache (float32, eager, as in
test_prompt_logprob_cache.py, which explains why a shared context is compared within a
tolerance and a whole cached prompt to the last bit).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import _launch_server
from test_grammar_agreement_ranks import _identical_batch_logs, _read_log
from srt.scheduler.prompt_logprob_cache import RECOMPUTE_ROWS

TOL = 1e-4
ARGS = ["--tp-size", "2", "--dtype", "float32", "--disable-torch-compile",
        "--max-prefill-tokens", "256", "--chunked-prefill-size", "128"]


def _prompts(tok) -> tuple[list[int], list[list[int]]]:
    ctx = tok(" ".join(f"Record {i}: the {i % 4}th lamp of hall {i * 3 % 11} is lit." for i in range(30)))["input_ids"]
    choices = [tok(s, add_special_tokens=False)["input_ids"] for s in [" Yes", " It is the third lamp.", " No"]]
    return ctx, choices


def _score(client: httpx.Client, prompt) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _run(base: str, ctx: list[int], choices: list[list[int]]) -> dict:
    with httpx.Client(base_url=base, timeout=120) as client:
        info = client.get("/get_server_info").json()
        out = {"bytes": info["prompt_logprob_cache_bytes_per_token"]}
        out["alone"] = [_score(client, ctx + c) for c in choices]  # one after another
        out["again"] = _score(client, ctx + choices[1])
        other = [t + 1 for t in ctx[:40]] + ctx[40:]  # another context, then its choices together
        with ThreadPoolExecutor(3) as pool:
            out["together"] = list(pool.map(lambda c: _score(client, other + c), choices))
    return out


def _lps(resp: dict) -> tuple[list, list]:
    lp = resp["choices"][0]["logprobs"]
    return lp["token_logprobs"], lp["top_logprobs"]


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _close(a: dict, b: dict) -> bool:
    (x, s), (y, t) = _lps(a), _lps(b)
    return (len(x) == len(y) and x[0] is None and y[0] is None
            and all(abs(p - q) <= TOL for p, q in zip(x[1:], y[1:]))
            and all(u.keys() == v.keys() and all(abs(u[k] - v[k]) <= TOL for k in u)
                    for u, v in zip(s[1:], t[1:])))


def test_tp2_cached_prompt_logprobs_match_and_ranks_agree(tmp_path_factory, tiny_dir, smollm2_tokenizer):
    ctx, choices = _prompts(smollm2_tokenizer)
    logs = tmp_path_factory.mktemp("lp_cache_logs")
    results = {}
    for name, extra, env in (("on", [], {"GRAMSYNC_BATCH_LOG_DIR": str(logs)}),
                             ("off", ["--disable-prompt-logprob-cache"], None)):
        for base in _launch_server(tmp_path_factory, tiny_dir, ARGS + extra, env):
            results[name] = _run(base, ctx, choices)
    on, off = results["on"], results["off"]
    assert (on["bytes"], off["bytes"]) == (165, 0)  # reported, and counted in the KV budget
    # One after another: the context from the cache, within TOL of computing it.
    assert [_cached(r) for r in on["alone"]] == [0] + [len(ctx) - RECOMPUTE_ROWS] * 2
    assert all(_cached(r) == 0 for r in off["alone"])
    assert all(_close(a, b) for a, b in zip(on["alone"], off["alone"]))
    served = len(ctx) - RECOMPUTE_ROWS + 1
    first = _lps(on["alone"][0])
    assert all(_lps(r)[0][:served] == first[0][:served] and _lps(r)[1][:served] == first[1][:served]
               for r in on["alone"][1:])
    # The same prompt again: served whole from the cache, each position to the last bit the
    # number this server computed first: the context's from scoring ctx + " Yes" (the rows
    # the second choice recomputed are not stored again), the choice's from scoring it. Within
    # TOL of the uncached server, not bitwise: on a Xeon with AMX (2026-12-05) the same
    # context scored inside two prompts differed in the last bits, where an AMD EPYC gave
    # the same bits (test_prompt_logprob_cache.py's docstring: not batch-invariant).
    assert _cached(on["again"]) == len(ctx) + len(choices[1]) - 1
    again, alone1 = _lps(on["again"]), _lps(on["alone"][1])
    for part in (0, 1):  # token logprobs, top alternatives
        assert again[part] == first[part][:len(ctx)] + alone1[part][len(ctx):], part
    assert _close(on["again"], off["alone"][1])
    # Sent together: one scores the context, the others wait a step and reuse it.
    assert sorted(_cached(r) for r in on["together"]) == [0] + [len(ctx) - RECOMPUTE_ROWS] * 2
    assert all(_close(a, b) for a, b in zip(on["together"], off["together"]))
    _identical_batch_logs(logs)  # both ranks locked the same prefixes, step for step
    digests = [line for line in _read_log(logs / "batches_DP0_TP0.log") if " CACHE " in line]
    assert len({line.split()[2] for line in digests}) >= 5  # the tree changed over time
