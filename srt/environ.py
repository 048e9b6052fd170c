"""Every environment variable gramsync reads, declared once: name, type, default, meaning.

Values are read from ``os.environ`` at the moment of use (no cached module state), so a
test or launcher can set them per process. ``python launch.py --help`` prints the table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            if self.type is bool:
                return _parse_bool(raw)
            return self.type(raw)
        except ValueError as e:
            raise ValueError(
                f"Environment variable {self.name}={raw!r} is not a valid "
                f"{self.type.__name__}: {e}"
            ) from None


def _parse_bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0/true/false/yes/no/on/off")


SGLANG_REQ_WAITING_TIMEOUT = EnvVar(
    "SGLANG_REQ_WAITING_TIMEOUT", float, -1.0,
    "Seconds a request may wait in the queue before it is aborted (<=0: no limit).",
)
SGLANG_REQ_RUNNING_TIMEOUT = EnvVar(
    "SGLANG_REQ_RUNNING_TIMEOUT", float, -1.0,
    "Seconds a request may run after its first scheduling before it is aborted (<=0: no limit).",
)
SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = EnvVar(
    "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", int, 4096,
    "Cap on the new tokens a request reserves in the KV cache when it is admitted.",
)
GRAMSYNC_CACHE_DIR = EnvVar(
    "GRAMSYNC_CACHE_DIR", str, os.path.join(os.path.expanduser("~"), ".cache", "gramsync"),
    "Where converted GGUF checkpoints are cached (Hugging Face format).",
)
GRAMSYNC_SCHEDULER_IDLE_WAIT = EnvVar(
    "GRAMSYNC_SCHEDULER_IDLE_WAIT", float, 0.1,
    "Seconds an idle entry rank blocks waiting for new requests before looping (a request "
    "wakes it at once; each idle loop at TP > 1 is a broadcast to every rank).",
)
GRAMSYNC_SCHEDULER_BATCH_WAIT = EnvVar(
    "GRAMSYNC_SCHEDULER_BATCH_WAIT", float, 0.03,
    "Most seconds an idle entry rank keeps collecting requests that arrive within 3 ms of "
    "each other before it schedules them (a burst is prefilled as one batch); 0 disables.",
)
GRAMSYNC_STARTUP_TIMEOUT = EnvVar(
    "GRAMSYNC_STARTUP_TIMEOUT", float, 600.0,
    "Seconds the launcher waits for the scheduler ranks to load the model and report ready.",
)
SGLANG_GRAMMAR_POLL_INTERVAL = EnvVar(
    "SGLANG_GRAMMAR_POLL_INTERVAL", float, 0.005,
    "Seconds an idle scheduler iteration waits for pending grammar compiles (with a batch to run it only checks).",
)
SGLANG_GRAMMAR_MAX_POLL_ITERATIONS = EnvVar(
    "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS", int, 10000,
    "Scheduler iterations (busy or idle) a request may wait for its grammar before it is aborted (400, timed out).",
)
GRAMSYNC_GRAMMAR_COMPILE_WORKERS = EnvVar(
    "GRAMSYNC_GRAMMAR_COMPILE_WORKERS", int, 4,
    "Worker processes of each node's grammar compile pool, shared by the node's ranks "
    "(lowest CPU priority); 0 compiles on threads inside every rank instead.",
)
GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT = EnvVar(
    "GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT", float, 60.0,
    "Seconds one grammar may compile in the pool; then its worker is killed and the "
    "requests waiting for it fail with 400 (compile timed out).",
)
GRAMSYNC_BATCH_LOG_DIR = EnvVar(
    "GRAMSYNC_BATCH_LOG_DIR", str, "",
    "Directory where every scheduler rank writes the request ids of each batch it runs "
    "(batches_DP{d}_TP{t}.log; the ranks of a TP group must write identical files).",
)
GRAMSYNC_HOST_IP = EnvVar(
    "GRAMSYNC_HOST_IP", str, "",
    "Multi-node: the address of this node that the frontend uses to reach its entry ranks "
    "(default: the interface that routes to --dist-init-addr / MASTER_ADDR).",
)
GRAMSYNC_API_KEY = EnvVar(
    "GRAMSYNC_API_KEY", str, "",
    "API key every HTTP endpoint but /health requires, when --api-key is not given.",
)
GRAMSYNC_ADMIN_API_KEY = EnvVar(
    "GRAMSYNC_ADMIN_API_KEY", str, "",
    "Key for the admin endpoints, when --admin-api-key is not given.",
)
GRAMSYNC_CLUSTER_SECRET = EnvVar(
    "GRAMSYNC_CLUSTER_SECRET", str, "",
    "Multi-node: the secret every node shares (at least 32 characters), when "
    "--cluster-secret-file is not given; only its holders can use the cluster's ZMQ sockets.",
)

GRAMSYNC_CPU_PACKED_LINEAR = EnvVar(
    "GRAMSYNC_CPU_PACKED_LINEAR", bool, True,
    "On CPU, where the step is not compiled: pack the linear weights once for oneDNN "
    "(decode steps 1.2-2.1x faster than MKL's F.linear; rounding differs ~4e-6 relative). 0 keeps F.linear.",
)

GRAMSYNC_MALLOC = EnvVar(
    "GRAMSYNC_MALLOC", str, "mimalloc",
    "The allocator the model's processes preload (Linux): mimalloc (from the cmeel-mimalloc "
    "package; CPU decode steps 5-15% faster than glibc's), system, or the path of another "
    "allocator's shared library (jemalloc, tcmalloc).",
)

GRAMSYNC_CPU_SHM_COLLECTIVES = EnvVar(
    "GRAMSYNC_CPU_SHM_COLLECTIVES", bool, True,
    "On CPU, TP ranks on one machine all-reduce through shared memory (~10 us a decode "
    "row against ~1.9 ms over gloo; same sums). 0 keeps gloo for every collective.",
)

GRAMSYNC_COMPILE_CACHE = EnvVar(
    "GRAMSYNC_COMPILE_CACHE", bool, True,
    "Keep each rank's compiled steps on disk, keyed by checkpoint, flags, torch and CPU, so a "
    "restart loads them instead of compiling; a first start builds them in a separate process "
    "at nice 19 while serving eagerly (docs/speed.md 'Restarts'). 0: compile "
    "in a thread of the rank at every start.",
)
GRAMSYNC_FLA_KERNELS = EnvVar(
    "GRAMSYNC_FLA_KERNELS", bool, True,
    "On CUDA with fla-core installed, run the hybrid models' gated delta rule with FLA's Triton kernels "
    "(the torch path otherwise, and always for the per-row states speculation keeps). 0: the torch path.",
)
GRAMSYNC_AOTI_DECODE = EnvVar(
    "GRAMSYNC_AOTI_DECODE", bool, True,
    "On CPU at TP=1 (plain or int4 weights), build the compiled decode graphs as AOTInductor packages (loaded in about "
    "a second at a restart, no tracing, no guards per step; docs/speed.md 'Restarts'). 0: "
    "torch.compile's graphs, as at TP > 1.",
)
GRAMSYNC_COMPILE_CACHE_DIR = EnvVar(
    "GRAMSYNC_COMPILE_CACHE_DIR", str, "",
    "Where the compiled steps are kept (default: $GRAMSYNC_CACHE_DIR/compile), one folder per "
    "key; delete a folder to rebuild it.",
)
GRAMSYNC_CPU_GEMV = EnvVar(
    "GRAMSYNC_CPU_GEMV", bool, True,
    "On CPU, the compiled decode graphs' matmuls at up to 16 rows run a hand-written GEMV "
    "(srt/layers/cpu_gemv.cpp; bf16 with AVX512-BF16, fp32 with AVX512F or AVX2+FMA) instead of oneDNN or "
    "Inductor's GEMM template; other CPUs keep those. With AVX512-BF16 a 4-bit GGUF's codes and the int8 "
    "LM head also run our GEMVs (srt/layers/cpu_qgemv.cpp) instead of torch's int4 / int8 kernels. "
    "0 keeps the library paths (a new compile key: the graphs rebuild).",
)
GRAMSYNC_CPU_DECODE_ATTENTION = EnvVar(
    "GRAMSYNC_CPU_DECODE_ATTENTION", bool, True,
    "On CPU, decode attention (eager and compiled) runs a hand-written op that reads the KV pool "
    "in place (srt/layers/cpu_decode_attention.cpp) instead of gathering keys for torch's matmuls. "
    "0 keeps the torch path (a new compile key: the graphs rebuild).",
)
GRAMSYNC_SPEC_ROW_COST = EnvVar(
    "GRAMSYNC_SPEC_ROW_COST", float, 0.12,
    "Speculative decoding: one extra decode row's cost relative to a one-row step, where the "
    "step costs are not measured: with more than one rank (TP, PP), and for row counts a "
    "single rank has not run yet (higher: shorter, fewer drafts).",
)
GRAMSYNC_SPEC_MAX_ROWS = EnvVar(
    "GRAMSYNC_SPEC_MAX_ROWS", int, 16,
    "Speculative decoding: no drafting once a decode step has this many rows (requests plus "
    "fast-forwarded and drafted tokens): past it a step is compute-bound and rows are not free.",
)
GRAMSYNC_TORCH_COMPILE_AUTO = EnvVar(
    "GRAMSYNC_TORCH_COMPILE_AUTO", bool, True,
    "What neither --enable-torch-compile nor --disable-torch-compile means: compile the "
    "decode step and the prefill where they measure faster (CPU, any TP). The test suite sets 0 to skip "
    "compiling in every server it starts.",
)

ALL_ENV_VARS: tuple[EnvVar, ...] = (
    SGLANG_REQ_WAITING_TIMEOUT,
    SGLANG_REQ_RUNNING_TIMEOUT,
    SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION,
    GRAMSYNC_CACHE_DIR,
    GRAMSYNC_SCHEDULER_IDLE_WAIT,
    GRAMSYNC_SCHEDULER_BATCH_WAIT,
    GRAMSYNC_STARTUP_TIMEOUT,
    SGLANG_GRAMMAR_POLL_INTERVAL,
    SGLANG_GRAMMAR_MAX_POLL_ITERATIONS,
    GRAMSYNC_GRAMMAR_COMPILE_WORKERS,
    GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT,
    GRAMSYNC_BATCH_LOG_DIR,
    GRAMSYNC_HOST_IP,
    GRAMSYNC_API_KEY,
    GRAMSYNC_ADMIN_API_KEY,
    GRAMSYNC_CLUSTER_SECRET,
    GRAMSYNC_TORCH_COMPILE_AUTO,
    GRAMSYNC_SPEC_ROW_COST,
    GRAMSYNC_SPEC_MAX_ROWS,
    GRAMSYNC_COMPILE_CACHE,
    GRAMSYNC_AOTI_DECODE,
    GRAMSYNC_FLA_KERNELS,
    GRAMSYNC_COMPILE_CACHE_DIR,
    GRAMSYNC_CPU_PACKED_LINEAR,
    GRAMSYNC_CPU_GEMV,
    GRAMSYNC_CPU_SHM_COLLECTIVES,
    GRAMSYNC_MALLOC,
)


def format_env_table() -> str:
    """Plain-text table for ``--help`` (docs/operations.md has the same table in Markdown)."""
    lines = ["environment variables:"]
    for v in ALL_ENV_VARS:
        lines.append(f"  {v.name} ({v.type.__name__}, default {v.default!r})")
        lines.append(f"      {v.help}")
    return "\n".join(lines)
