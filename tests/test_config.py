"""ServerArgs CLI generation, environment variable parsing and the launcher's --help."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from srt import environ
from srt.server_args import ServerArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(argv))


def test_cli_flags_follow_sglang_names():
    args = parse(["--model-path", "/m", "--tp-size", "1", "--max-total-tokens", "1000",
                  "--max-running-requests", "8", "--port", "8123", "--mem-fraction-static", "0.5"])
    assert (args.model_path, args.max_total_tokens, args.port) == ("/m", 1000, 8123)
    assert args.max_running_requests == 8 and args.mem_fraction_static == 0.5
    assert parse([]) == ServerArgs()


def test_server_args_frozen_and_validated():
    with pytest.raises(Exception):
        ServerArgs().port = 1  # frozen
    with pytest.raises(ValueError, match="max-running-requests"):
        ServerArgs(max_running_requests=0)
    with pytest.raises(ValueError, match="mem-fraction-static"):
        ServerArgs(mem_fraction_static=1.5)
    assert ServerArgs().resolved().random_seed is not None
    assert ServerArgs(random_seed=5).resolved().random_seed == 5


def test_env_vars_typed_with_clear_errors(monkeypatch):
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "2.5")
    assert environ.SGLANG_REQ_WAITING_TIMEOUT.get() == 2.5
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_REQ_WAITING_TIMEOUT='soon'"):
        environ.SGLANG_REQ_WAITING_TIMEOUT.get()
    monkeypatch.delenv("SGLANG_REQ_WAITING_TIMEOUT")
    assert environ.SGLANG_REQ_WAITING_TIMEOUT.get() == -1.0


def test_launch_help_lists_flags_and_env_vars():
    out = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--model-path", "--tp-size", "--max-total-tokens", "--watchdog-timeout"):
        assert flag in out.stdout
    for var in environ.ALL_ENV_VARS:
        assert var.name in out.stdout


def test_launch_rejects_bad_flag_value():
    out = subprocess.run([sys.executable, "launch.py", "--max-running-requests", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "max-running-requests" in out.stderr


def test_readme_documents_every_env_var():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for var in environ.ALL_ENV_VARS:
        assert f"`{var.name}`" in readme, var.name
