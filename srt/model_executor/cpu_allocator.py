"""The memory allocator of the processes that run the model: mimalloc, preloaded.

A compiled CPU decode step is ~300 kernels and library calls, and each allocates and frees
its outputs and oneDNN's descriptors through ``malloc``. With glibc's allocator that was
~13% of the step's main thread at batch 1 (``perf``: ``_int_malloc``, ``_int_free``,
``malloc_consolidate``). mimalloc also backs its large regions with transparent huge pages
(glibc does not ask for them), so the weights stream through 2 MB pages: 1.2 GB of the
served process in huge pages against none. With it preloaded the served step ran 10-15%
faster at batch 1 and 4-13% at 4-16 rows (docs/speed.md, "The allocator"). PyTorch's CPU performance guide
recommends the same (jemalloc or tcmalloc, through ``LD_PRELOAD``); mimalloc comes from
PyPI (``cmeel-mimalloc``), so ``pip`` installs it with everything else.

An allocator must be loaded before the process's first ``malloc``, so it cannot be
switched in-process: the launcher re-executes itself with ``LD_PRELOAD`` set (every process
it starts inherits it), and ranks spawned from a user's own Python process (``Engine``) get
it through their environment. ``GRAMSYNC_MALLOC`` chooses: ``mimalloc`` (default),
``system`` (glibc's), or the path of another allocator's shared library (jemalloc,
tcmalloc). Linux only; elsewhere, or where the library is missing, nothing changes.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import sys
from typing import Iterator, Mapping, Optional

from srt import environ

logger = logging.getLogger(__name__)

_REEXEC_MARK = "GRAMSYNC_MALLOC_REEXEC"  # set across our own exec: never exec twice


def _mimalloc_path() -> Optional[str]:
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    # libmimalloc.so, .so.3, .so.3.4: the shortest name that exists is the canonical one.
    libs = [str(f.locate()) for f in files if f.name.startswith("libmimalloc.so")]
    return min((p for p in libs if os.path.exists(p)), key=len, default=None)


def allocator_library(choice: Optional[str] = None) -> Optional[str]:
    """The shared library to preload for ``choice`` (default ``GRAMSYNC_MALLOC``), or None
    for glibc's own. ValueError for a path that does not exist (a file that ld.so cannot
    preload is only warned about, by ld.so, and the process runs on glibc's allocator)."""
    choice = (choice if choice is not None else environ.GRAMSYNC_MALLOC.get()).strip()
    if not sys.platform.startswith("linux") or choice in ("", "system"):
        return None
    if choice == "mimalloc":
        path = _mimalloc_path()
        if path is None:
            logger.warning("GRAMSYNC_MALLOC=mimalloc but the cmeel-mimalloc package is not "
                           "installed: using the system allocator")
        return path
    if not os.path.isfile(choice):
        raise ValueError(f"GRAMSYNC_MALLOC={choice!r}: expected mimalloc, system, or the path "
                         "of an allocator's shared library; no such file")
    return choice


def preload_env(env: Mapping[str, str], library: Optional[str]) -> dict[str, str]:
    """``env`` with ``library`` first in ``LD_PRELOAD`` (kept once, others kept after it)."""
    out = dict(env)
    if library:
        rest = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p != library]
        out["LD_PRELOAD"] = " ".join([library] + rest)
    return out


def loaded_allocator() -> Optional[str]:
    """The preloaded allocator mapped into this process (a path), or None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    for name in ("libmimalloc", "libjemalloc", "libtcmalloc"):
        for line in maps.splitlines():
            if name in line:
                return line.split()[-1]
    return None


@contextlib.contextmanager
def children_preloaded() -> Iterator[Optional[str]]:
    """While inside, processes started from here (``spawn``, ``subprocess``) preload the
    allocator; this process's own environment is restored after."""
    library = allocator_library()
    if library is None or loaded_allocator() is not None:  # none wanted, or ours inherit it
        yield loaded_allocator()
        return
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = preload_env(os.environ, library)["LD_PRELOAD"]
    try:
        yield library
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def reexec_with_allocator() -> None:
    """For our own entry scripts (``launch.py``, the benchmarks), called before anything
    heavy is imported: run this same command again with the allocator preloaded. Returns
    when it is already loaded, not wanted, or not available."""
    if os.environ.get(_REEXEC_MARK):
        os.environ.pop(_REEXEC_MARK)
        return
    try:
        library = allocator_library()
    except ValueError as e:
        sys.exit(f"error: {e}")
    if library is None or loaded_allocator() is not None:  # not wanted, or already there
        return
    env = preload_env(os.environ, library)
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
