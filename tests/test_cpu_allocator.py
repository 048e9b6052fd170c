"""The preloaded allocator (srt/model_executor/cpu_allocator.py): which library, and that the processes
we start really map it (real subprocesses, read from their /proc/self/maps)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from srt.model_executor import cpu_allocator
from srt.model_executor.cpu_allocator import allocator_library, children_preloaded, preload_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = "from srt.model_executor.cpu_allocator import loaded_allocator; print(loaded_allocator())"


def _run(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def _env(**kv) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GRAMSYNC_MALLOC")}
    env.update(kv)
    return env


def test_mimalloc_is_installed_and_default():
    path = allocator_library("mimalloc")
    assert path is not None and os.path.isfile(path) and "libmimalloc.so" in path
    assert allocator_library("") is None and allocator_library("system") is None


def test_a_missing_library_is_a_clear_error():
    with pytest.raises(ValueError, match="GRAMSYNC_MALLOC='/no/such/libjemalloc.so'.*no such file"):
        allocator_library("/no/such/libjemalloc.so")


def test_mimalloc_missing_falls_back_to_the_system(monkeypatch, caplog):
    monkeypatch.setattr(cpu_allocator, "_mimalloc_path", lambda: None)
    assert allocator_library("mimalloc") is None
    assert "cmeel-mimalloc package is not installed" in caplog.text


def test_preload_env_puts_ours_first_once():
    env = preload_env({"LD_PRELOAD": "/a.so:/lib/m.so /b.so"}, "/lib/m.so")
    assert env["LD_PRELOAD"] == "/lib/m.so /a.so /b.so"
    assert preload_env({}, "/lib/m.so")["LD_PRELOAD"] == "/lib/m.so"
    assert "LD_PRELOAD" not in preload_env({}, None)


def test_reexec_maps_the_allocator_and_honours_system():
    code = f"from srt.model_executor.cpu_allocator import reexec_with_allocator; reexec_with_allocator(); {REPORT}"
    assert "libmimalloc.so" in _run(code, _env())
    assert _run(code, _env(GRAMSYNC_MALLOC="system")) == "None"


def test_an_allocator_the_user_preloads_is_kept_and_nothing_is_added():
    """A process started with an allocator already in LD_PRELOAD (here mimalloc through a
    name of the user's own choosing) is not re-executed, and its LD_PRELOAD is untouched."""
    user_lib = allocator_library("mimalloc")
    code = ("import os; from srt.model_executor.cpu_allocator import reexec_with_allocator; reexec_with_allocator(); "
            "print(os.environ['LD_PRELOAD'], os.environ.get('GRAMSYNC_MALLOC_REEXEC'))")
    out = _run(code, _env(LD_PRELOAD=user_lib, GRAMSYNC_MALLOC="system"))
    assert out == f"{user_lib} None"
    out = _run(code, _env(LD_PRELOAD=user_lib))  # mimalloc wanted, one already there
    assert out == f"{user_lib} None"


def test_children_started_inside_get_it_and_the_parent_env_is_restored(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("GRAMSYNC_MALLOC", raising=False)
    if cpu_allocator.loaded_allocator() is not None:
        pytest.skip("this test process already preloads an allocator")
    with children_preloaded() as lib:
        assert lib is not None and "libmimalloc.so" in lib
        child = _run(REPORT, dict(os.environ))
    assert "libmimalloc.so" in child
    assert "LD_PRELOAD" not in os.environ


def test_an_engines_rank_process_maps_mimalloc(fp32_engine):
    """The ranks spawned by ``Engine`` (spawn_local_ranks) run with the allocator."""
    pids = [p.pid for p in fp32_engine._handles.procs]
    assert pids
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "libmimalloc.so" in f.read(), f"rank pid {pid} has no mimalloc mapped"


def test_a_launch_py_server_and_its_rank_map_mimalloc(server):
    """``python launch.py`` (the shared session server) re-executed itself with the allocator,
    and the rank it spawned inherited it: read from their /proc/<pid>/maps."""
    import psutil

    port = int(server.rsplit(":", 1)[1])

    def listens(p) -> bool:  # setproctitle renamed them: find the launcher by its port
        try:
            return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in p.net_connections(kind="tcp"))
        except psutil.Error:
            return False

    mains = [p for p in psutil.Process().children() if listens(p)]
    assert len(mains) == 1, mains
    procs = [mains[0]] + [c for c in mains[0].children(recursive=True) if "gramsync::scheduler" in c.name()
                          or any("gramsync::scheduler" in a for a in c.cmdline())]
    assert len(procs) >= 2  # the launcher (the frontend) and at least its rank
    for p in procs:
        with open(f"/proc/{p.pid}/maps") as f:
            assert "libmimalloc.so" in f.read(), f"pid {p.pid} ({p.cmdline()[:3]}) has no mimalloc mapped"
