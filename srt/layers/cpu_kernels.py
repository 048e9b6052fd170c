"""Builds and loads gramsync's own CPU ops (namespace ``gramsync``) into this process.

Hand-written kernels, each where measurement showed the library path falls short, each
checked against a torch reference: ``small_linear`` (cpu_gemv.cpp, the small-batch GEMV),
``decode_attention`` (cpu_decode_attention.cpp, decode attention read in place from the
KV pool), ``int4_linear`` and ``int8_linear`` (cpu_qgemv.cpp, quantized GEMVs), and
``apply_token_bitmask_`` (constrained/bitmask_cpu.cpp, the grammar's vocab mask) and
``greedy_argmax`` (sampling/greedy_cpu.cpp). One
library, built from source with the C++ compiler Inductor already needs
(``torch.utils.cpp_extension``, ~20 s once per machine, kept under ``TORCH_EXTENSIONS_DIR``),
so an AOTInductor package that calls any of the ops finds them all registered.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, name) for name in ("cpu_gemv.cpp", "cpu_decode_attention.cpp", "cpu_qgemv.cpp")]
# The grammar's vocab mask and greedy sampling on CPU (constrained/bitmask_ops.py and
# sampling/greedy.py call them once the library is loaded).
_ROOT = os.path.dirname(os.path.dirname(_HERE))
SOURCES += [os.path.join(_ROOT, "constrained", "bitmask_cpu.cpp"), os.path.join(_ROOT, "sampling", "greedy_cpu.cpp")]
PANEL = 16  # the GEMV's weight rows per panel (cpu_gemv.pack_weight)
LIBRARY = "gramsync_cpu_kernels"


def dynamo_constant(fn):
    """``torch.compiler.assume_constant_result`` without importing Dynamo, which that call
    does (1.5 s of every rank's start, for eager steps that never trace): in torch 2.13 it
    only sets this flag (test_cpu_kernels_build.py checks that it still does)."""
    fn._dynamo_marked_constant = True
    return fn


@contextlib.contextmanager
def _builder_lock(build_dir: str):
    """One builder at a time per build folder, by an OS lock the kernel drops when its holder
    dies. cpp_extension's own lock is a file that a killed builder (a server stopped during
    its first start) leaves behind, and every later load then waits on it forever; under
    this lock no other builder is alive, so a leftover one is stale and is removed."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "gramsync-builder.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes or the process dies
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            os.remove(stale)
        yield


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (once per machine) and load the ops; False, with a warning, where they cannot be
    built (no compiler): callers then keep the torch paths. Cached: the ops stay registered
    for the process's life, and a failure is not retried every trace."""
    try:
        from torch.utils import cpp_extension

        build_dir = cpp_extension._get_build_directory(LIBRARY, verbose=False)  # honours TORCH_EXTENSIONS_DIR
        with _builder_lock(build_dir):
            cpp_extension.load(name=LIBRARY, sources=SOURCES, extra_cflags=["-O3", "-fopenmp"],
                               build_directory=build_dir, is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the torch paths stay
        logger.warning("gramsync's CPU kernels could not be built (%s: %s); the torch paths stay",
                       type(e).__name__, str(e)[:300])
        return False
    torch.library.register_fake("gramsync::small_linear")(_small_linear_fake)
    torch.library.register_fake("gramsync::decode_attention")(_decode_attention_fake)
    torch.library.register_fake("gramsync::int4_linear")(_int4_linear_fake)
    torch.library.register_fake("gramsync::int8_linear")(_int8_linear_fake)
    return True


def _small_linear_fake(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], wp.shape[0] * PANEL))


def _decode_attention_fake(q, k, v, slots, valid, scaling):
    return q.new_empty(q.shape)


def _int4_linear_fake(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], wp.shape[0] * PANEL))


def _int8_linear_fake(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], wp.shape[0] * PANEL))
