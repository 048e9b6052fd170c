"""The radix cache at TP=2 through the real server: both ranks hold the same tree, step for
step, over a workload that forces eviction, and cache hits do not change greedy outputs.

Every rank logs a digest of its whole tree after each batch (GRAMSYNC_BATCH_LOG_DIR); the
two logs must be identical line for line. fp32, so that batching cannot change greedy
tokens; a pool of 200 tokens, so that the cached prefixes must be evicted.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import _launch_server
from test_grammar_agreement_ranks import _read_log

SYSTEMS = [f"You are assistant number {i}. You answer in one short sentence and you "
           f"always stay polite, calm and precise about the topic of {topic}. "
           for i, topic in enumerate(["rivers", "bread", "stars", "trains"])]
QUESTIONS = ["What is it?", "Why does it matter?", "Tell me one fact."]


def _bodies():
    return [{"text": system + q, "rid": f"p{i}-{j}",
             "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
            for i, system in enumerate(SYSTEMS) for j, q in enumerate(QUESTIONS)]


def test_tp2_ranks_hold_the_same_tree_and_outputs_match_cold_runs(tmp_path_factory, tiny_dir):
    logs = tmp_path_factory.mktemp("cache_logs")
    args = ["--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "200",
            "--max-running-requests", "4"]
    for base in _launch_server(tmp_path_factory, tiny_dir, args, {"GRAMSYNC_BATCH_LOG_DIR": str(logs)}):
        with httpx.Client(base_url=base, timeout=60) as client:
            cold = {}
            for body in _bodies()[::3]:  # one per system prompt, each after a flush: no hits
                assert client.post("/flush_cache").status_code == 200
                out = client.post("/generate", json=body).json()
                assert out["meta_info"]["cached_tokens"] == 0
                cold[body["rid"]] = out["output_ids"]
            assert client.post("/flush_cache").status_code == 200
            with ThreadPoolExecutor(4) as pool:  # all 12 concurrently: hits and evictions
                hot = list(pool.map(lambda b: client.post("/generate", json=b).json(), _bodies()))
    by_rid = {o["meta_info"]["id"]: o for o in hot}
    for rid, ids in cold.items():
        assert by_rid[rid]["output_ids"] == ids, rid
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in hot) >= 3
    deadline = time.monotonic() + 15
    while True:  # a rank may still be writing its last line
        a, b = _read_log(logs / "batches_DP0_TP0.log"), _read_log(logs / "batches_DP0_TP1.log")
        if (a == b and a) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert a == b, "the ranks' batch logs (and tree digests) differ"
    cache_lines = [line.split() for line in a if " CACHE " in line]
    assert len({digest for _, _, digest, _ in cache_lines}) > 5  # the tree changed over time
    assert int(cache_lines[-1][3]) > 0, "the workload never evicted"
    assert os.path.getsize(logs / "batches_DP0_TP0.log") > 0
