"""Multi-rank serving end to end, with REAL processes on CPU (gloo on 127.0.0.1):

- ``--tp-size 2``: the openai client, constrained output, a tool call, greedy ids equal to TP=1, and the
  two TP ranks running identical batches (``GRAMSYNC_BATCH_LOG_DIR``);
- ``--dp-size 2``: requests spread over both DP groups, greedy ids equal to TP=1, and an
  abort (client disconnect) reaching the group that runs the request;
- ``torchrun --nproc-per-node 2 launch.py --tp-size 2``: a constrained request, a clean stop;
- failures naming the rank: a SIGKILLed rank (TP=2, or either stage at ``--pp-size 2``)
  takes the server down with nothing left behind, a rank failing at
  start-up (``tests/fail_on_rank_plugin.py``) is named with its traceback, and bad
  parallel layouts are rejected by ``ServerArgs``;
- cheap unit tests of ``DPDispatcher`` and ``torchrun_server_args``.

The machine may have 2 cores: one server of each kind (module-scoped), greedy and short.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import jsonschema
import openai
import psutil
import pytest

from conftest import ROOT, _launch_server
from test_metrics import samples, value
from process_helpers import stop_process_group

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
STARTUP_TIMEOUT_S = 150

# Sent one at a time (batch shapes equal to the TP=1 reference's), greedy.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
    "1, 2, 3, 4,",
    "The quick brown fox",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"


# ---- helpers -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)


def _generate(base: str, text: str, rid: str | None = None, **params) -> dict:
    body = {"text": text, "sampling_params": params}
    if rid is not None:
        body["rid"] = rid
    r = httpx.post(base + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy_ids(base: str, rid_prefix: str | None = None) -> list[list[int]]:
    """Output ids of PROMPTS, one request at a time (never batched together)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        rid = f"{rid_prefix}-{i}" if rid_prefix else None
        res = _generate(base, prompt, rid=rid, **GREEDY)
        assert res["meta_info"]["finish_reason"]["type"] in ("length", "stop"), res
        out.append(res["output_ids"])
    return out


def _batches(log_dir: str, rank: str) -> list[tuple[str, list[str]]]:
    """(mode, rids) per complete line of ``batches_<rank>.log`` (a missing file: none)."""
    path = os.path.join(log_dir, f"batches_{rank}.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # only complete lines: the rank may be writing
    out = []
    for line in lines:
        _step, mode, rids = line.split(" ", 2)
        if mode == "AGREE":  # token agreement record, not a batch
            continue
        out.append((mode, [r for r in rids.split(",") if r]))
    return out


def _rids_in(batches) -> set[str]:
    return {rid for _mode, rids in batches for rid in rids}


def _wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _server_info(base: str) -> dict:
    return httpx.get(base + "/get_server_info", timeout=10).json()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(proc: subprocess.Popen, base: str, log_path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _healthy(base):
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{_tail(log_path)}")
        time.sleep(0.1)


def _tail(log_path, n: int = 4000) -> str:
    with open(log_path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


def _popen(cmd: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
    finally:
        log.close()  # the child has its own copy


def _launch_cmd(model_dir: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "launch.py", "--max-total-tokens", "4096", "--port", str(port),
            "--model-path", model_dir, "--served-model-name", "smollm2",
            "--log-level", "warning", *extra]


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (is_running() also guards against a reused pid)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip()  # setproctitle pads with spaces
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _stop(proc: subprocess.Popen, extra: list[psutil.Process] = ()) -> None:
    """Take down a started server: its process group (SIGTERM, then SIGKILL), then any
    recorded descendant that lives in another session (torchrun workers) and is left."""
    stop_process_group(proc)
    for p in extra:
        if _alive(p):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


# ---- fixtures ------------------------------------------------------------------------
# float32 everywhere greedy ids are compared: with bfloat16 (``--dtype auto`` on CPUs with
# AVX512-BF16) each TP rank's partial sums are rounded to bf16 before the all-reduce, so
# logits move by ~0.5 and a near-tie (e.g. a 0.03 margin) can flip; in float32 TP=2 logits
# differ from TP=1 by ~3e-5 (summation order only) and greedy ids must be equal.
FP32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def tp1_ids(fp32_engine) -> list[list[int]]:
    """The reference: greedy ids of PROMPTS at TP=1 in float32, one request at a time, from
    the session's float32 Engine (the same scheduler a TP=1 server runs, without a server
    of its own to start)."""
    out = []
    for prompt in PROMPTS:
        res = fp32_engine.generate(prompt, dict(GREEDY))
        assert res["meta_info"]["finish_reason"]["type"] in ("length", "stop"), res
        out.append(res["output_ids"])
    return out


# tp2_server: session-scoped in conftest.py (test_fuzz_requests.py fuzzes the same server).


@pytest.fixture(scope="module")
def dp2_server(tmp_path_factory, smollm2_dir):
    """(base URL, batch-log dir) of a ``--dp-size 2`` server (two TP=1 groups, --enable-metrics)."""
    log_dir = str(tmp_path_factory.mktemp("dp2_batches"))
    for base in _launch_server(tmp_path_factory, smollm2_dir, ["--dp-size", "2", "--enable-metrics", *FP32],
                               env={"GRAMSYNC_BATCH_LOG_DIR": log_dir}):
        yield base, log_dir


# ---- cheap unit tests ------------------------------------------------------------------
def test_dp_dispatcher_round_robin():
    from srt.frontend.dp_dispatch import DPDispatcher

    d = DPDispatcher(3)
    assert [d.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert d.in_flight == [3, 2, 2]
    d.done(0)
    d.done(2)
    assert d.in_flight == [2, 2, 1]
    assert d.pick() == 1  # round robin ignores the load


def test_dp_dispatcher_shortest_queue():
    from srt.frontend.dp_dispatch import DPDispatcher

    d = DPDispatcher(3, "shortest_queue")
    assert [d.pick() for _ in range(3)] == [0, 1, 2]  # ties: the lowest group
    assert d.pick() == 0 and d.in_flight == [2, 1, 1]
    d.done(2)  # group 2 now has the fewest in flight
    assert d.in_flight == [2, 1, 0] and d.pick() == 2 and d.in_flight == [2, 1, 1]
    d.done(0)
    d.done(0)
    assert d.in_flight == [0, 1, 1] and d.pick() == 0 and d.pick() == 0
    assert d.in_flight == [2, 1, 1] and d.pick() == 1 and d.in_flight == [2, 2, 1]
    with pytest.raises(ValueError, match="Unknown load balance method 'fastest'"):
        DPDispatcher(2, "fastest")


def test_torchrun_world_must_match_flags(monkeypatch):
    from srt.entrypoints.torchrun import torchrun_server_args
    from srt.server_args import ServerArgs

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args, rank = torchrun_server_args(ServerArgs(tp_size=2, dp_size=2))
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, 1, "10.0.0.1:29500")
    assert (rank.world_rank, rank.dp_rank, rank.tp_rank, rank.name) == (3, 1, 1, "DP1_TP1")
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but --tp-size 2 x "
                                         r"--dp-size 1 = 2: they must match"):
        torchrun_server_args(ServerArgs(tp_size=2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "2", "--dp-size", "1", "--nnodes", "3", "--dist-init-addr", "127.0.0.1:1"],
     "error: --tp-size x --dp-size (2 ranks) must split evenly over --nnodes 3"),
    (["--tp-size", "2", "--nnodes", "2"],
     "error: --nnodes > 1 needs --dist-init-addr host:port (node 0's address)"),
    (["--tp-size", "0"], "error: --tp-size and --dp-size must be at least 1"),
], ids=["nnodes-3", "nnodes-2-without-dist-init-addr", "tp-size-0"])
def test_bad_parallel_layout_is_rejected(flags, message):
    """ServerArgs validation in a real ``launch.py``: a clear message, a non-zero exit,
    before any rank is started."""
    proc = subprocess.run([sys.executable, "launch.py", "--port", str(_free_port()), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_a_taken_port_fails_before_any_rank_starts(tiny_dir):
    """The HTTP port is bound first (srt/entrypoints/http_socket.py): a taken port is a
    clear message and exit 1 at once, not after the model has loaded; and while a server
    starts no other socket (its ranks' gloo ones included) can take the port it named."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(_launch_cmd(tiny_dir, port, "--tp-size", "2"), cwd=ROOT,
                              capture_output=True, text=True, timeout=50)
        elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert (f"gramsync: cannot bind the HTTP port 127.0.0.1:{port}: address already in use"
            in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "scheduler" not in proc.stderr.lower(), proc.stderr  # no rank was started
    assert elapsed < 20, f"the taken port was reported after {elapsed:.1f} s"


# ---- TP=2 ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_tp2_openai_client(tp2_server):
    base, _ = tp2_server
    client = _client(base)
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello in one sentence."}],
        max_tokens=16, temperature=0)
    assert chat.choices[0].message.content.strip()
    assert chat.usage.completion_tokens > 0
    comp = client.completions.create(model="smollm2", prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert comp.choices[0].text.strip() and comp.choices[0].finish_reason == "length"

    phone = client.completions.create(model="smollm2", prompt="My phone number is ",
                                      max_tokens=16, temperature=0,
                                      extra_body={"regex": PHONE_REGEX})
    assert re.fullmatch(PHONE_REGEX, phone.choices[0].text), phone.choices[0].text
    assert phone.choices[0].finish_reason == "stop"

    person = client.chat.completions.create(
        model="smollm2", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Describe Alice, who is 30, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})
    assert person.choices[0].finish_reason == "stop", person.choices[0].message.content
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON_SCHEMA)


@pytest.mark.timeout(240)
def test_tp2_tool_call(tp2_server):
    """A required tool call (the tools' grammar, --grammar-backend auto) at TP=2."""
    base, _ = tp2_server
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    r = _client(base).chat.completions.create(
        model="smollm2", max_tokens=48, temperature=0, tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": params}}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), params)


@pytest.mark.timeout(240)
def test_tp2_n_and_logprobs(tp2_server):
    """n > 1 (prompt prefilled once, samples from the cache) with output and prompt logprobs at
    TP=2: logprobs come from the entry rank; both ranks take the same prefill decisions."""
    base, log_dir = tp2_server
    r = httpx.post(f"{base}/generate", timeout=120, json={
        "text": "Count with me: one, two,", "rid": "tp2-n-lp",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "seed": 2, "n": 3},
        "return_logprob": True, "top_logprobs_num": 2})
    assert r.status_code == 200, r.text
    outs = r.json()
    prompt_tokens = outs[0]["meta_info"]["prompt_tokens"]
    assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [prompt_tokens - 1] * 2
    for o in outs:
        meta = o["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == o["output_ids"]
        assert all(e[0] <= 0 and len(top) == 2 for e, top in zip(meta["output_token_logprobs"],
                                                                  meta["output_top_logprobs"]))
    r = httpx.post(f"{base}/generate", timeout=120, json={
        "text": "Count with me: one, two,", "rid": "tp2-prompt-lp", "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True, "logprob_start_len": 1})
    assert len(r.json()["meta_info"]["input_token_logprobs"]) == prompt_tokens - 1
    rids = {f"tp2-n-lp-{i}" for i in range(3)} | {"tp2-prompt-lp"}
    _wait_until(lambda: (_batches(log_dir, "DP0_TP0") == _batches(log_dir, "DP0_TP1")
                         and rids <= _rids_in(_batches(log_dir, "DP0_TP1"))),
                10, "identical batch logs of DP0_TP0 and DP0_TP1")


@pytest.mark.timeout(240)
def test_tp2_greedy_equals_tp1(tp2_server, tp1_ids):
    base, log_dir = tp2_server
    tp2_ids = _greedy_ids(base, rid_prefix="tp2-greedy")
    for prompt, want, got in zip(PROMPTS, tp1_ids, tp2_ids):
        assert got == want, f"TP=2 differs from TP=1 for {prompt!r}"
    # Lock-step: both TP ranks ran the same batches (ranks may lag by a line or two).
    _wait_until(lambda: (_batches(log_dir, "DP0_TP0") == _batches(log_dir, "DP0_TP1")
                         and {f"tp2-greedy-{i}" for i in range(len(PROMPTS))}
                         <= _rids_in(_batches(log_dir, "DP0_TP1"))),
                10, "identical batch logs of DP0_TP0 and DP0_TP1")


# ---- DP=2 ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_dp2_spreads_requests_and_matches_tp1(dp2_server, tp1_ids):
    base, log_dir = dp2_server
    chat = _client(base).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0)
    assert chat.choices[0].message.content.strip()

    prefix = f"dp2-{uuid.uuid4().hex[:8]}"
    dp_ids = _greedy_ids(base, rid_prefix=prefix)
    for prompt, want, got in zip(PROMPTS, tp1_ids, dp_ids):
        assert got == want, f"DP=2 differs from TP=1 for {prompt!r}"

    mine = {f"{prefix}-{i}" for i in range(len(PROMPTS))}
    groups = [_rids_in(_batches(log_dir, f"DP{d}_TP0")) & mine for d in (0, 1)]
    # Sequential requests under round robin alternate groups: 3 and 3, never both.
    assert len(groups[0]) == len(groups[1]) == len(PROMPTS) // 2, groups
    assert groups[0] | groups[1] == mine and not groups[0] & groups[1]
    assert not os.path.exists(os.path.join(log_dir, "batches_DP0_TP1.log"))  # TP=1 groups


@pytest.mark.timeout(240)
def test_dp2_abort_reaches_the_right_group(dp2_server):
    base, log_dir = dp2_server
    aborted_before = _server_info(base)["num_aborted_requests"]
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    body = {"text": "Write a very long essay about the sea.", "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    chunks = 0
    with httpx.stream("POST", base + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if chunks == 3:
                    break  # leaving the block closes the connection: the server aborts
    assert chunks == 3
    _wait_until(lambda: (_server_info(base)["num_aborted_requests"] > aborted_before
                         and _server_info(base)["num_inflight_requests"] == 0),
                20, "the frontend to abort the request")
    assert _healthy(base)

    # Round robin: two sequential requests land one on each group, after the abort.
    after = [f"after-{rid}-{i}" for i in range(2)]
    for a in after:
        res = _generate(base, "Hi", rid=a, max_new_tokens=4, temperature=0)
        assert res["meta_info"]["completion_tokens"] == 4

    logs = {d: _batches(log_dir, f"DP{d}_TP0") for d in (0, 1)}
    holders = [d for d in (0, 1) if rid in _rids_in(logs[d])]
    assert len(holders) == 1, f"{rid} ran in groups {holders}"
    group = logs[holders[0]]
    runs = [rids for _mode, rids in group if rid in rids]
    assert len(runs) < 200, f"{rid} ran {len(runs)} steps: the abort did not stop it"
    later = [rids for _mode, rids in group if set(after) & set(rids)]
    assert later, f"no follow-up request ran in group DP{holders[0]}"
    assert all(rid not in rids for rids in later), f"{rid} still ran after the abort"


def _grammar_compiles(base: str, regex: str, requests: int) -> dict:
    """Send ``requests`` requests constrained by a fresh ``regex``; then the scraped
    /metrics once every DP group's entry rank reported its compile."""
    for _ in range(requests):
        _generate(base, "My code is ", regex=regex, temperature=0, max_new_tokens=8)
    deadline = time.monotonic() + 15
    while True:
        p = samples(httpx.get(base + "/metrics", timeout=10).text)
        counts = [value(p, "sglang:grammar_compilation_time_seconds_count", dp_rank=str(d), kind="regex")
                  for d in range(requests)]
        if all(counts) or time.monotonic() > deadline:
            return p


@pytest.mark.timeout(120)
def test_tp2_metrics_include_the_grammar_agreement(tp2_server):
    """Only the entry rank reports; the cross-rank agreement time exists only at TP > 1."""
    p = _grammar_compiles(tp2_server[0], f"{uuid.uuid4().hex[:6]}-[0-9]{{3}}", 1)
    assert value(p, "sglang:grammar_compilation_time_seconds_count", dp_rank="0", backend="xgrammar") >= 1
    assert value(p, "sglang:grammar_agreement_time_seconds_count", dp_rank="0") >= 1
    assert {lb for (n, lb) in p if n == "sglang:num_running_reqs"} == {(("dp_rank", "0"), ("model_name", "smollm2"))}


@pytest.mark.timeout(120)
def test_dp2_metrics_arrive_from_every_group(dp2_server):
    """Each DP group's entry rank sends its own gauges and grammar counters (dp_rank label)."""
    p = _grammar_compiles(dp2_server[0], f"{uuid.uuid4().hex[:6]}-[0-9]{{3}}", 2)  # round robin: one each
    for d in ("0", "1"):
        assert value(p, "sglang:grammar_compilation_time_seconds_count", dp_rank=d, kind="regex") >= 1, d
        assert value(p, "sglang:max_total_num_tokens", dp_rank=d) == 4096
    assert value(p, "sglang:num_requests_total") >= 2


# ---- torchrun --------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_torchrun_tp2_constrained_and_clean_stop(tmp_path, smollm2_dir):
    port, master_port = _free_port(), _free_port()
    log_path = tmp_path / "torchrun.log"
    proc = _popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                   *_launch_cmd(smollm2_dir, port, "--tp-size", "2")[1:]], log_path)
    base = f"http://127.0.0.1:{port}"
    seen: list[psutil.Process] = []
    try:
        _wait_healthy(proc, base, log_path)
        seen = [p for p in _descendants(proc) if _title(p).startswith("gramsync::")]
        titles = sorted(_title(p) for p in seen if "grammar_compile" not in _title(p))
        # One grammar compile pool for the node, shared by its two ranks.
        assert titles == ["gramsync::frontend", "gramsync::grammar_pool_node0",
                          "gramsync::scheduler_DP0_TP0", "gramsync::scheduler_DP0_TP1"], titles
        _wait_until(lambda: any(_title(p).startswith("gramsync::grammar_compile_node0_")
                                for p in _descendants(proc)), 30, "the pool's compile workers")

        res = _generate(base, "My phone number is ", regex=PHONE_REGEX, max_new_tokens=16,
                        temperature=0)
        assert re.fullmatch(PHONE_REGEX, res["text"]), res["text"]
        res = _generate(base, "Describe Alice, who is 30, as JSON:",
                        json_schema=json.dumps(PERSON_SCHEMA), max_new_tokens=64, temperature=0)
        assert res["meta_info"]["finish_reason"]["type"] == "stop", res
        jsonschema.validate(json.loads(res["text"]), PERSON_SCHEMA)

        from test_graceful_shutdown import _chat_stream

        stream = _chat_stream(base, 12)  # in flight at the SIGTERM: it runs to its end
        stream.start()
        stream.wait_events(2)
        proc.send_signal(signal.SIGTERM)  # stop torchrun itself, as a user or a job system
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not stop within 60 s of SIGTERM:\n{_tail(log_path)}")
        _wait_until(lambda: not any(_alive(p) for p in seen), 15,
                    "every gramsync:: process of torchrun to exit")
        assert not _healthy(base)
        stream.finish()
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        assert json.loads(stream.events[-2])["choices"][0]["finish_reason"] == "length", stream.events[-3:]
        log = _tail(log_path, 50000)
        assert "scheduler crashed" not in log and "lost contact" not in log, log  # a clean stop
    finally:
        _stop(proc, seen)


# ---- a rank dies -----------------------------------------------------------------------
def _exit_with(code: int) -> None:
    os._exit(code)


def test_the_rank_that_failed_first_is_named(tmp_path):
    """When one rank dies its peers follow within a poll interval (a peer that only lost
    contact exits with PEER_LOST_EXIT_CODE), so the launcher can find several dead at once:
    it names a rank killed by a signal first and a rank that only lost a peer last."""
    import multiprocessing as mp

    from srt.entrypoints.launcher import SchedulerHandles
    from srt.process_utils import PEER_LOST_EXIT_CODE

    ctx = mp.get_context("fork")
    peer_lost = ctx.Process(target=_exit_with, args=(PEER_LOST_EXIT_CODE,), name="DP0_TP0")
    crashed = ctx.Process(target=_exit_with, args=(1,), name="DP0_TP1")
    killed = ctx.Process(target=time.sleep, args=(60,), name="DP0_TP2")
    procs = [peer_lost, crashed, killed]
    handles = SchedulerHandles(procs)
    try:
        for p in procs:
            p.start()
        assert handles.dead_rank() in (None, f"scheduler rank DP0_TP1 (pid {crashed.pid}) exited with code 1",
                                       f"scheduler rank DP0_TP0 (pid {peer_lost.pid}) exited with code 3")
        peer_lost.join(10)
        assert handles.dead_rank() is not None
        crashed.join(10)
        assert handles.dead_rank() == f"scheduler rank DP0_TP1 (pid {crashed.pid}) exited with code 1"
        killed.kill()
        killed.join(10)
        assert handles.dead_rank() == f"scheduler rank DP0_TP2 (pid {killed.pid}) exited with code -9"
    finally:
        handles.shutdown(timeout=10)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout, victim_rank", [
    (["--tp-size", "2"], "DP0_TP1"),
    # Pipeline stages: the first stage (not the entry rank: no socket to the frontend) and
    # the last (the entry rank, which samples for every stage).
    (["--pp-size", "2"], "DP0_PP0_TP0"),
    (["--pp-size", "2"], "DP0_PP1_TP0"),
], ids=["tp2", "pp2-first-stage", "pp2-last-stage"])
def test_killed_rank_stops_the_server(tmp_path, tiny_dir, layout, victim_rank):
    watchdog_timeout = 20
    port = _free_port()
    log_path = tmp_path / "server.log"
    proc = _popen(_launch_cmd(tiny_dir, port, *layout,
                              "--watchdog-timeout", str(watchdog_timeout)), log_path)
    base = f"http://127.0.0.1:{port}"
    group: list[psutil.Process] = []
    try:
        _wait_healthy(proc, base, log_path)
        group = [psutil.Process(proc.pid), *_descendants(proc)]
        victim = [p for p in group if _title(p) == f"gramsync::scheduler_{victim_rank}"]
        assert len(victim) == 1, [_title(p) for p in group]
        assert _generate(base, "Hi", max_new_tokens=2, temperature=0)["meta_info"][
            "completion_tokens"] == 2
        from test_graceful_shutdown import _chat_stream

        stream = _chat_stream(base, 1000)  # in flight when the rank dies
        stream.start()
        stream.wait_events(2)

        t0 = time.monotonic()
        victim[0].send_signal(signal.SIGKILL)
        try:
            code = proc.wait(watchdog_timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running {watchdog_timeout} s after {victim_rank} was killed:\n"
                        f"{_tail(log_path)}")
        elapsed = time.monotonic() - t0
        log = _tail(log_path, 20000)
        dead = f"scheduler rank {victim_rank} (pid {victim[0].pid}) exited with code -9"
        assert code != 0, log
        assert elapsed < watchdog_timeout
        assert dead in log, log
        _wait_until(lambda: not any(_alive(p) for p in group), 10,
                    "every process of the server to exit")
        assert not _healthy(base)
        assert code == 1, log
        assert f"gramsync: {dead}; the server stopped." in log, log
        stream.finish()  # its error event came before the connection closed
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == 503 and "A scheduler process has exited" in error["message"], error
    finally:
        _stop(proc, group)


# ---- a rank fails to start ---------------------------------------------------------------
@pytest.mark.timeout(180)
def test_startup_failure_names_the_rank(tmp_path, tiny_dir):
    """One rank (DP0_TP1) raises while building its scheduler: the launcher exits non-zero
    with that rank's name and traceback, and takes the other ranks down."""
    log_path = tmp_path / "server.log"
    pythonpath = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    proc = _popen(_launch_cmd(tiny_dir, _free_port(), "--tp-size", "2",
                              "--grammar-backend-plugins", "fail_on_rank_plugin"),
                  log_path, env={"PYTHONPATH": pythonpath, "GRAMSYNC_TEST_FAIL_RANK": "DP0_TP1"})
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while proc.poll() is None:  # record the ranks while they live
            for p in _descendants(proc):
                seen.setdefault(p.pid, p)
            if time.monotonic() > deadline:
                pytest.fail(f"launcher still running after {STARTUP_TIMEOUT_S} s:\n{_tail(log_path)}")
            time.sleep(0.2)
        log = _tail(log_path, 50000)
        assert proc.returncode == 1, log
        assert "gramsync: scheduler DP0_TP1 failed to start:" in log, log
        assert "Traceback" in log and "RuntimeError: injected start-up failure on DP0_TP1" in log
        assert "DP0_TP0 failed to start" not in log
        assert len(seen) >= 2, "the launcher started no ranks"
        _wait_until(lambda: not any(_alive(p) for p in seen.values()), 10,
                    "every rank of the failed launch to exit")
    finally:
        _stop(proc, list(seen.values()))


def test_dp_dispatcher_prefix_aware_follows_the_cache_within_the_load_slack():
    from srt.frontend.dp_dispatch import DPDispatcher

    d = DPDispatcher(2, "prefix_aware", balance_slack=1)
    chat = list(range(100, 140))
    assert d.pick(chat) == 0  # nothing cached anywhere: the shortest queue
    assert d.pick(list(range(500, 540))) == 1  # another prefix: the other (shorter) group
    # The chat's next turns (its history + more) follow it to group 0 while the load allows.
    assert d.pick(chat + [7, 8]) == 0 and d.pick(chat + [9]) == 0
    assert d.prefix_routed == 2 and d.in_flight == [3, 1]
    assert d.pick(chat + [10]) == 1  # group 0 is 2 busier: the shortest queue wins
    d.done(0)
    d.done(0)
    assert d.in_flight == [1, 2]
    assert d.pick(chat + [11]) == 0  # both groups hold the chat now: the less busy one
    assert d.pick([1, 2, 3]) == 0  # no match: the shortest queue (ties: the lowest group)
    assert d.pick(None) == 1  # no ids: the shortest queue
