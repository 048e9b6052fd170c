"""Where a rank's compiled steps are kept across restarts, and under which key.

Inductor keeps what it compiles in its own caches (the FX graph cache and AOTAutograd's,
plus the built C++ kernels) under ``TORCHINDUCTOR_CACHE_DIR``; a restart that traces the
same graphs loads them instead of compiling again (docs/speed.md, "Restarts"). Two things
make torch's own keys not enough for a server:

- With ``freezing``, the FX cache keys each weight by its shape and dtype only, and keeps
  the constants Inductor derives while compiling (the C++ GEMM template's repacked
  weights) inside the entry. Another checkpoint of the same architecture would hit that
  entry and compute with the first checkpoint's weights.
- Each rank holds its own shard, and compiled graphs depend on the flags that shape them.

A third thing stops torch's cache altogether in bf16: the freezing pass prepacks each
bf16 weight as a oneDNN (mkldnn) tensor, and the FX cache refuses any graph holding one
("mkldnn tensors unpickleable"), though it keys frozen weights by metadata and takes them
from the live graph at load, never pickling them. ``allow_frozen_mkldnn_weights`` extends
that same rule to frozen mkldnn weights (a mkldnn tensor that is not a frozen weight still
refuses the cache, as before); fp32 graphs never needed it.

So every rank compiles into a folder of its own, named by a hash of what the graphs are
built from: the checkpoint's files (name, size, mtime and a digest of their first and
last MiB), gramsync's model and layer code, the config overrides, dtype, quantization, TP size and rank, the graph sizes,
whether the decode graphs are AOTInductor packages (``aoti_decode.py``),
torch's version and the CPU's flags. A stale or foreign entry is never read: it lives in
another folder. ``key.json`` in each folder lists the key's parts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time

import torch

from srt import environ
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "complete"  # in a folder: every graph of its key was built there
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_EDGE = 1 << 20  # bytes hashed at each end of a weight file: cheap, and catches a re-export
# The repository root (this file is srt/model_executor/compiled/cache.py).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Our code that the compiled graphs are traced from. Inductor keys each graph by its own
# content, so a change here is never served stale; but without it in our key a folder
# stays "complete" while every graph misses, and the rank would compile in process,
# beside serving, instead of in the builder.
GRAPH_SOURCES = ("srt/models", "srt/layers", "srt/model_executor/forward_batch.py",
                 "srt/model_executor/compiled/decode.py", "srt/model_executor/compiled/aoti_decode.py",
                 "srt/model_executor/compiled/prefill.py", "distributed/communication.py",
                 "distributed/eager_collectives.py")


def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if st.st_size > 2 * _EDGE:
            f.seek(-_EDGE, os.SEEK_END)
            h.update(f.read(_EDGE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edges_sha256": h.hexdigest()}


def checkpoint_fingerprint(model_dir: str) -> dict:
    """Every weight file and config.json of the checkpoint, by name."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(_WEIGHT_SUFFIXES) or name == "config.json":
            out[name] = _file_fingerprint(os.path.join(model_dir, name))
    return out


def code_digest(root: str = _REPO, sources: tuple[str, ...] = GRAPH_SOURCES) -> str:
    """sha256 over every .py (and .cpp: our CPU kernels) file under ``sources`` (relative to ``root``), path and bytes."""
    h = hashlib.sha256()
    for src in sources:
        top = os.path.join(root, src)
        files = [top] if os.path.isfile(top) else sorted(
            os.path.join(d, n) for d, _, names in os.walk(top) for n in names if n.endswith((".py", ".cpp")))
        for path in files:
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def cache_complete(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, COMPLETE_MARKER))


def mark_complete(folder: str) -> None:
    with open(os.path.join(folder, COMPLETE_MARKER), "w") as f:
        f.write(f"{time.time():.0f}\n")


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return sorted(set(next((ln for ln in f if ln.startswith("flags")), "").split()[2:]))
    except OSError:
        return [platform.processor()]


def compile_cache_key(args: ServerArgs, model_dir: str, dtype: torch.dtype, tp_size: int,
                      tp_rank: int, max_compiled_bs: int, weights: str = "checkpoint") -> dict:
    """``weights``: what the linear layers hold ("checkpoint", or "gguf-int4": a GGUF's own codes)."""
    return {
        "checkpoint": checkpoint_fingerprint(model_dir),
        "code": code_digest(),
        "model_overrides": args.json_model_override_args,
        "dtype": str(dtype),
        "torchao_config": args.torchao_config,
        "weights": weights,
        "tp": [tp_size, tp_rank],
        "ep_size": args.ep_size,  # which experts, and how much of each, this rank holds
        "max_compiled_bs": max_compiled_bs,
        "mixed_chunk": args.enable_mixed_chunk,
        "aoti_decode": environ.GRAMSYNC_AOTI_DECODE.get(),
        "cpu_gemv": environ.GRAMSYNC_CPU_GEMV.get(),
        "cpu_decode_attention": environ.GRAMSYNC_CPU_DECODE_ATTENTION.get(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
    }


def allow_frozen_mkldnn_weights() -> bool:
    """Key a frozen mkldnn weight by shape and dtype in Inductor's FX cache, as torch keys
    every other frozen weight (see the module docstring). Safe only because the folder is
    keyed by the checkpoint. Returns False (and changes nothing) where this torch lacks the
    pieces it wraps: the graphs then bypass the cache, as without it."""
    try:
        from torch._inductor import codecache
        from torch._inductor.freezing_utils import is_frozen_param
        pickler, validator = codecache.FxGraphCachePickler, codecache.CacheabilityValidator
        original_reduce, original_check = pickler._reduce_tensor, validator.check_tensor
        ident = codecache._ident
    except (ImportError, AttributeError):
        return False
    if getattr(original_reduce, "gramsync_frozen_mkldnn", False):
        return True

    def frozen_mkldnn(t) -> bool:
        return t.is_mkldnn and is_frozen_param(t)

    def check_tensor(t) -> None:  # the validator's refusal, except for frozen weights
        if not frozen_mkldnn(t):
            original_check(t)

    def reduce_tensor(self, t):  # the key: shape and dtype, as for other frozen weights
        if frozen_mkldnn(t):
            return ident, (("frozen-mkldnn", tuple(t.shape), str(t.dtype)),)
        return original_reduce(self, t)

    reduce_tensor.gramsync_frozen_mkldnn = True
    validator.check_tensor = staticmethod(check_tensor)
    pickler._reduce_tensor = reduce_tensor
    return True


def inductor_cache_counts() -> str:
    """This process's FX graph cache outcomes so far, e.g. ``hits 14, misses 0, bypassed 0``
    (a rank compiles nothing but its steps: a restart that loaded everything shows no miss)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return (f"hits {c['fxgraph_cache_hit']}, misses {c['fxgraph_cache_miss']}, "
            f"bypassed {c['fxgraph_cache_bypass']}")


def use_compile_cache(args: ServerArgs, model_dir: str, dtype: torch.dtype, tp_size: int,
                      tp_rank: int, max_compiled_bs: int, log_prefix: str,
                      weights: str = "checkpoint") -> str | None:
    """Point Inductor's caches at this rank's keyed folder (before anything compiles);
    returns the folder, or None where ``GRAMSYNC_COMPILE_CACHE`` is off.

    ``TORCHINDUCTOR_CACHE_DIR`` is how Inductor takes its folder; each rank is its own
    process, so setting it there touches no other rank."""
    if not environ.GRAMSYNC_COMPILE_CACHE.get():
        return None
    key = compile_cache_key(args, model_dir, dtype, tp_size, tp_rank, max_compiled_bs, weights)
    blob = json.dumps(key, sort_keys=True)
    root = environ.GRAMSYNC_COMPILE_CACHE_DIR.get() or os.path.join(environ.GRAMSYNC_CACHE_DIR.get(), "compile")
    folder = os.path.join(root, hashlib.sha256(blob.encode()).hexdigest()[:24])
    os.makedirs(folder, exist_ok=True)
    key_file = os.path.join(folder, "key.json")
    if not os.path.exists(key_file):
        tmp = f"{key_file}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(key, f, indent=1, sort_keys=True)
        os.replace(tmp, key_file)
    logger.info("%s compile cache %s (%s)", log_prefix, folder,
                "complete: loading it" if cache_complete(folder) else "not complete: this start builds it")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    allow_frozen_mkldnn_weights()
    return folder
