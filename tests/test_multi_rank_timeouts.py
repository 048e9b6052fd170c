"""Wall-clock timeouts at TP=2 and at --pp-size 2 behave as at TP=1: the entry rank decides
them and broadcasts them as aborts (to its TP peers; with pipeline stages, to every stage),
so both ranks drop the request in the same step."""
from __future__ import annotations

import concurrent.futures as cf
import os
import time

import httpx
import pytest

from conftest import _launch_server


LAYOUTS = {"tp2": (["--tp-size", "2"], ("DP0_TP0", "DP0_TP1")),
           "pp2": (["--pp-size", "2"], ("DP0_PP0_TP0", "DP0_PP1_TP0"))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def timeout_server(request, tmp_path_factory, smollm2_dir):
    """(base URL, batch-log dir, the two ranks' names)."""
    flags, ranks = LAYOUTS[request.param]
    log_dir = str(tmp_path_factory.mktemp("batches"))
    env = {"SGLANG_REQ_RUNNING_TIMEOUT": "3", "GRAMSYNC_BATCH_LOG_DIR": log_dir}
    for base in _launch_server(tmp_path_factory, smollm2_dir, flags, env):
        yield base, log_dir, ranks


def _lines(log_dir: str, rank: str) -> list[str]:
    with open(os.path.join(log_dir, f"batches_{rank}.log")) as f:
        return f.read().split("\n")[:-1]


@pytest.mark.timeout(240)
def test_running_timeout_aborts_on_every_rank(timeout_server):
    base, log_dir, ranks = timeout_server

    def generate(rid: str, max_new_tokens: int) -> httpx.Response:
        body = {"rid": rid, "text": "Tell me a long story.",
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                    "ignore_eos": True}}
        return httpx.post(base + "/generate", json=body, timeout=120)

    with cf.ThreadPoolExecutor(3) as pool:
        long = pool.submit(generate, "too-long", 4000)
        short = [pool.submit(generate, f"short-{i}", 4) for i in range(2)]
        results = [f.result() for f in short]
        aborted = long.result()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert aborted.status_code == 503, aborted.text
    assert "SGLANG_REQ_RUNNING_TIMEOUT" in aborted.json()["error"]["message"], aborted.text
    deadline = time.monotonic() + 15  # a rank may still be writing its last line
    while True:
        rank0, rank1 = (_lines(log_dir, rank) for rank in ranks)
        if rank0 == rank1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rank0 and rank0 == rank1, "the ranks ran different batches"
    # It ran for a while (3 s of decode steps) and then left both ranks' batches together.
    assert sum("too-long" in line for line in rank0) > 3
