"""Compiled steps at TP=2: a real ``--tp-size 2`` server (two scheduler processes, gloo and
the shared-memory segment) with ``--enable-torch-compile``, fp32.

- While both ranks compile (in the background, their warm-up collectives kept local), the
  server answers with the eager steps.
- Both ranks switch in the same agreed step (``COMPILED decode=1 prefill=1`` at the same
  line of identical batch logs), and no graph fell back to eager.
- Greedy ids before and after the switch, at batch 1 and at a batch of 3 (the dynamic
  graph), equal TP=1's eager ids from an in-process scheduler on the same prompts.

The model is the embedded SmolLM2 cut to its first ``LAYERS`` layers
(``--json-model-override-args``): the compile's cost grows with depth, what is checked here
does not (test_compiled_decode.py does the same at TP=1).
"""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from conftest import FP32_SERVER, _launch_server
from test_compiled_decode import LAYERS

MAX_RUNNING = 3  # graphs: batch 1 and batches 2-3
NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:", "1, 2, 3, 4,", "The quick brown fox"]
OVERRIDES = json.dumps({"num_hidden_layers": LAYERS})

pytestmark = pytest.mark.timeout(900)  # two ranks compile on 2 cores: ~3 minutes here


@pytest.fixture(scope="module")
def compiled_tp2(tmp_path_factory, smollm2_dir):
    log_dir = tmp_path_factory.mktemp("compiled_tp2_batches")
    logs: list = []
    args = ["--tp-size", "2", *FP32_SERVER, "--enable-torch-compile", "--max-running-requests",
            str(MAX_RUNNING), "--json-model-override-args", OVERRIDES]
    for base in _launch_server(tmp_path_factory, smollm2_dir, args,
                               {"GRAMSYNC_BATCH_LOG_DIR": str(log_dir)}, log_paths=logs):
        yield base, log_dir, logs[0]


@pytest.fixture(scope="module")
def tp1_reference(smollm2_dir, smollm2_tokenizer):
    """TP=1, eager, same layers and dtype: {prompt ids: greedy ids}."""
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from sampling.sampling_params import SamplingParams
    from srt.model_executor.model_config import ModelConfig
    from srt.scheduler.scheduler import Scheduler
    from srt.server_args import ServerArgs, parse_model_overrides
    from srt.transport.io_struct import TokenizedGenerateReq

    args = ServerArgs(model_path=smollm2_dir, dtype="float32", max_running_requests=1,
                      max_total_tokens=4096, json_model_override_args=OVERRIDES, disable_torch_compile=True)
    sched = Scheduler(args, RankInfo(), SINGLE_RANK,
                      ModelConfig.from_path(smollm2_dir, None, parse_model_overrides(OVERRIDES)), smollm2_tokenizer)
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    out = {}
    for i, text in enumerate(PROMPTS):
        ids = tuple(smollm2_tokenizer(text)["input_ids"])
        sched.process_input_requests([TokenizedGenerateReq(f"ref-{i}", ids, params)])
        req = sched.reqs[f"ref-{i}"]
        while sched.has_work():
            sched.step()
        out[ids] = list(req.output_ids)
    return out


def _greedy(base: str, ids: tuple) -> list[int]:
    body = {"input_ids": list(ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    r = httpx.post(base + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _log(path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _switch_line(log_dir, timeout: float) -> str:
    """The COMPILED line, once both ranks wrote it (each rank's scheduler only loops while
    it has work, so keep one short request going)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [[x for x in _log(log_dir / f"batches_DP0_TP{r}.log") if " COMPILED " in x] for r in (0, 1)]
        if all(lines):
            assert lines[0] == lines[1], lines
            return lines[0][0]
        time.sleep(1)
    pytest.fail(f"no agreed switch to the compiled steps within {timeout} s")


def _identical_logs(log_dir, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        a, b = (_log(log_dir / f"batches_DP0_TP{r}.log") for r in (0, 1))
        if (a == b and a) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert a and a == b, "the ranks' batch logs differ"
    return a


def test_ranks_switch_to_the_compiled_steps_together_and_keep_tp1s_greedy_ids(
        compiled_tp2, tp1_reference):
    base, log_dir, server_log = compiled_tp2
    prompts = list(tp1_reference)
    # While compiling: the eager steps answer.
    assert _greedy(base, prompts[0]) == tp1_reference[prompts[0]]
    assert not any(" COMPILED " in x for x in _log(log_dir / "batches_DP0_TP0.log"))

    # Keep the loop turning (a short request every few seconds) until both ranks switched.
    deadline = time.monotonic() + 800
    line = None
    while line is None and time.monotonic() < deadline:
        _greedy(base, prompts[1])
        time.sleep(3)  # mostly idle: each rank's compile builder (nice 19) gets the cores
        lines = [x for x in _log(log_dir / "batches_DP0_TP0.log") if " COMPILED " in x]
        line = lines[0] if lines else None
    assert line is not None, "no agreed switch to the compiled steps"
    assert _switch_line(log_dir, 30).split(" ", 1)[1] == "COMPILED decode=1 prefill=1", line
    switch_step = int(line.split()[0])

    # After the switch: batch 1 (static graph), then a batch of 3 (the dynamic graph).
    got = {p: _greedy(base, p) for p in prompts[:2]}
    with concurrent.futures.ThreadPoolExecutor(MAX_RUNNING) as pool:
        got.update(zip(prompts[2:5], pool.map(lambda p: _greedy(base, p), prompts[2:5])))
    for p, ids in got.items():
        assert ids == tp1_reference[p], f"prompt {p}: TP=2 compiled {ids} vs TP=1 {tp1_reference[p]}"

    log = _identical_logs(log_dir)
    batch_steps = [int(x.split()[0]) for x in log if x.split()[1] in ("DECODE", "EXTEND", "MIXED")]
    assert max(batch_steps) > switch_step + NEW_TOKENS  # batches ran after the switch
    text = server_log.read_text()
    for marker in ("decoding eagerly", "prefilling eagerly", "staying eager", "Traceback"):
        assert marker not in text, f"{marker!r} in the server log:\n{text[-3000:]}"
