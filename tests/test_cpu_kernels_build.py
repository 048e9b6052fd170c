"""Building gramsync's CPU kernels survives a builder that was killed mid-build.

cpp_extension guards a build with a plain `lock` file; a process killed while building (a
server stopped during its first start, a compile builder cut at shutdown) leaves it behind,
and every later load used to wait on it forever. load_cpu_kernels holds an OS lock while it
builds, so a `lock` file found under it is stale and is removed. Real build folder, real
processes: the child loads the (already built) library with a stale lock planted.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from srt.layers.cpu_kernels import LIBRARY, load_cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_lock_left_by_a_killed_builder_does_not_hang_the_next_load():
    if not load_cpu_kernels():
        pytest.skip("no C++ compiler: the torch paths are used and nothing is built")
    from torch.utils import cpp_extension

    stale = os.path.join(cpp_extension._get_build_directory(LIBRARY, verbose=False), "lock")
    with open(stale, "w"):
        pass  # what FileBaton leaves when its holder is killed
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from srt.layers.cpu_kernels import load_cpu_kernels; "
             "print('loaded', load_cpu_kernels())"],
            cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("load_cpu_kernels waited on a stale build lock")
    finally:
        if os.path.exists(stale):
            os.remove(stale)
    assert "loaded True" in done.stdout, done.stderr[-2000:]
    assert "left by a kernel build that was killed" in done.stderr
