"""ServerArgs CLI generation, environment variable parsing and the launcher's --help."""
from __future__ import annotations

import argparse
import os
import re
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


def test_running_request_cap_defaults_by_device():
    """16 running requests on CPU (compute-bound from about 16 rows, docs/speed.md), 64 on
    CUDA; an explicit value wins; resolved() writes the number in for every rank."""
    assert ServerArgs(device="cpu").max_running() == 16
    assert ServerArgs(device="cuda").max_running() == 64
    assert ServerArgs(device="cpu", max_running_requests=40).max_running() == 40
    assert ServerArgs(device="cpu").resolved().max_running_requests == 16
    assert ServerArgs(device="cpu").state_slots() == 48
    with pytest.raises(ValueError, match=r"max-mamba-cache-size \(8\) must be at least --max-running-requests \(16\)"):
        ServerArgs(device="cpu", max_mamba_cache_size=8)


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


def _doc_files():
    """README.md and every page under docs/ (repository-relative paths)."""
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md"] + docs


def _read(rel):
    return open(os.path.join(ROOT, rel), encoding="utf-8").read()


def test_readme_documents_every_env_var():
    # The table of environment variables moved from the README to docs/operations.md: every
    # variable still needs its own row there, backquoted, and the README + docs must name it.
    table = _read(os.path.join("docs", "operations.md"))
    everything = "\n".join(_read(f) for f in _doc_files())
    for var in environ.ALL_ENV_VARS:
        assert f"| `{var.name}` |" in table, f"{var.name}: no row in docs/operations.md's environment-variable table"
        assert f"`{var.name}`" in everything, var.name


def test_readme_is_at_most_300_lines():
    # The README is the ten-minute introduction; everything else lives in docs/ (issue 33).
    n = len(_read("README.md").splitlines())
    assert n <= 300, f"README.md has {n} lines; move detail into docs/"


def _github_anchor(heading):
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown):
    anchors, seen, in_code = set(), {}, False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"^#{1,6} +(.*?) *#*$", line)
        if m:
            base = _github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def _links(markdown):
    """Targets of the inline Markdown links outside code blocks and code spans."""
    prose, in_code = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code and not line.startswith("    "):
            prose.append(re.sub(r"`[^`]*`", "", line))
    return re.findall(r"\]\(([^)\s]+)\)", "\n".join(prose))


def test_doc_links_point_to_existing_files_and_headings():
    files = _doc_files()
    assert len(files) > 1, "docs/ holds no pages"
    bad = []
    for rel in files:
        for target in _links(_read(rel)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
            if not os.path.exists(os.path.join(ROOT, dest)):
                bad.append(f"{rel}: {target} (no file {dest})")
            elif fragment and dest.endswith(".md") and fragment not in _anchors(_read(dest)):
                bad.append(f"{rel}: {target} (no heading #{fragment} in {dest})")
    assert not bad, "broken links:\n" + "\n".join(bad)
