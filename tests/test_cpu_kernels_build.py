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


def test_dynamo_constant_marks_a_function_as_torch_compiler_does():
    """cpu_kernels.dynamo_constant stands in for torch.compiler.assume_constant_result so
    that a rank's start need not import Dynamo: both must leave the same marks."""
    import torch

    from srt.layers.cpu_kernels import dynamo_constant

    def ours():
        return True

    def torchs():
        return True

    dynamo_constant(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_a_ranks_modules_load_without_dynamo():
    """Dynamo costs 1.5 s of CPU to import; eager ranks never trace, so the modules a rank
    imports at its start (scheduler_process._RANK_MODULES) must not pull it in."""
    code = ("import importlib, sys; from srt.scheduler.scheduler_process import _RANK_MODULES; "
            "[importlib.import_module(m) for m in _RANK_MODULES]; import srt.model_executor.model_loader; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_every_kernel_source_ships_with_its_package():
    """Each C++ source the library builds from exists and is package data of its package
    (pyproject.toml), so a wheel install builds the same ops as a checkout."""
    import fnmatch
    import tomllib

    from srt.layers import cpu_kernels

    root = ROOT
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert len(cpu_kernels.SOURCES) == 5
    for src in cpu_kernels.SOURCES:
        assert os.path.isfile(src), src
        package = ".".join(os.path.relpath(os.path.dirname(src), root).split(os.sep))
        assert any(fnmatch.fnmatch(os.path.basename(src), g) for g in data.get(package, [])), src
