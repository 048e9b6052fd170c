"""The node's grammar compile pool is private (issue 32): its directory is a fresh mkdtemp
one, checked (real directory, ours, mode 0700) by the service before it binds and by every
rank before it connects; a rank that refuses it compiles on its own threads. A pool
planted by another process at the path the old code derived from a token gets nothing.
Single-node ranks meet through a file store in the private run directory (no TCP store)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import jsonschema
import psutil
import pytest
from process_helpers import wait_for

from constrained.base_grammar_backend import InvalidGrammarObject
from distributed.parallel_state import RankInfo
from srt.grammar_pool.client import CompilePoolClient
from srt.grammar_pool.node_pool import NodePool, start_node_pool
from srt.grammar_pool.private_dir import (new_pool_dir, pool_dir_problem, pool_endpoint_problem,
                                          pool_socket_address)
from srt.grammar_pool.service import PoolConfig, PoolService, start_pool_service
from srt.server_args import ServerArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, EOS = 49152, (2,)
NOBODY = 65534
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
def dirs():
    """Directories made by a test; removed afterwards whatever their owner or mode."""
    made: list[str] = []
    yield made
    for d in made:
        subprocess.run(["rm", "-rf", d], timeout=30)


def _dir(made: list[str], mode: int = 0o700) -> str:
    d = tempfile.mkdtemp(prefix="gramsync-test-")
    made.append(d)
    os.chmod(d, mode)
    return d


# ---- (1) the check ----------------------------------------------------------------------
def test_check_accepts_only_a_private_directory_of_ours(dirs):
    fresh = new_pool_dir()
    dirs.append(fresh)
    assert pool_dir_problem(fresh) is None
    assert pool_endpoint_problem(pool_socket_address(fresh)) is None  # not bound yet: fine
    assert "mode 755" in pool_dir_problem(_dir(dirs, 0o755))
    assert "mode 710" in pool_dir_problem(_dir(dirs, 0o710))
    foreign = _dir(dirs)
    os.chown(foreign, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}" in pool_dir_problem(foreign)
    link = os.path.join(_dir(dirs), "link")
    os.symlink(fresh, link)  # to a good directory: still refused
    assert "symlink" in pool_dir_problem(link)
    plain = os.path.join(fresh, "file")
    open(plain, "w").close()
    assert "not a directory" in pool_dir_problem(plain)
    assert "cannot be read" in pool_dir_problem(os.path.join(fresh, "missing"))
    assert foreign in pool_endpoint_problem(pool_socket_address(foreign))


def test_rank_refuses_a_socket_it_does_not_own(dirs):
    d = _dir(dirs)
    path = os.path.join(d, "pool")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        assert pool_endpoint_problem(f"ipc://{path}") is None
        os.chown(path, NOBODY, NOBODY)
        assert f"owned by uid {NOBODY}" in pool_endpoint_problem(f"ipc://{path}")
        with pytest.raises(PermissionError, match="owned by uid"):
            CompilePoolClient(f"ipc://{path}")
    os.unlink(path)
    open(path, "w").close()
    assert "not a socket" in pool_endpoint_problem(f"ipc://{path}")


def test_rank_refusing_the_pool_compiles_on_its_own_threads(dirs, smollm2_dir, smollm2_tokenizer, caplog):
    from constrained.registry import create_grammar_backend

    args = ServerArgs(model_path=smollm2_dir, grammar_backend="xgrammar", log_level="warning")
    bad = _dir(dirs, 0o755)
    for local_rank in (0, 1):  # the first rank would also have started the service there
        rank = RankInfo(tp_rank=local_rank, tp_size=2, world_rank=local_rank, world_size=2,
                        local_rank=local_rank)
        with caplog.at_level("ERROR"):
            assert start_node_pool(args, rank, bad, VOCAB, EOS) is None
        assert f"refusing the grammar compile pool: grammar pool directory {bad} has mode 755" in caplog.text
        caplog.clear()
    # The directory turns bad after the pool was set up: attach refuses too, and the
    # backend keeps compiling locally.
    backend = create_grammar_backend(args, smollm2_tokenizer, VOCAB, EOS)
    with caplog.at_level("ERROR"):
        assert not NodePool(pool_socket_address(bad), None).attach(backend, "[DP0 TP1]")
    assert "[DP0 TP1] refusing the grammar compile pool" in caplog.text
    assert backend.compile_pool is None
    value, hit = backend.get_cached_or_future_value(("json_schema", json.dumps(PERSON)))
    grammar = value if hit else value.result(120)
    assert not isinstance(grammar, InvalidGrammarObject) and grammar.stats.dispatch_type == "xgrammar"


# ---- (3) the service refuses to bind ------------------------------------------------------
def test_service_refuses_a_directory_that_fails_the_check(dirs, smollm2_dir, capfd):
    args = ServerArgs(model_path=smollm2_dir, grammar_backend="xgrammar", log_level="warning")
    open_dir = _dir(dirs, 0o755)
    with pytest.raises(PermissionError, match="mode 755"):
        PoolService(PoolConfig(args, VOCAB, EOS, 0, open_dir, pool_socket_address(open_dir), 1, 3.0), None)
    assert os.listdir(open_dir) == []
    foreign = _dir(dirs)
    os.chown(foreign, NOBODY, NOBODY)
    proc = start_pool_service(PoolConfig(args, VOCAB, EOS, 0, foreign, pool_socket_address(foreign), 1, 3.0))
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = capfd.readouterr().err
    assert f"refusing to start the grammar compile pool: grammar pool directory {foreign} is owned by uid {NOBODY}" in err
    assert os.path.isdir(foreign) and os.listdir(foreign) == []  # not bound, not removed


# ---- (2) a pool planted at the old, derived path ---------------------------------------
# Plants the directory and a ROUTER at argv[1]/pool; takes the path back whenever another
# socket replaces its file (as a local attacker racing the old service would); answers
# every task with garbage marked as an exact xgrammar grammar; counts what it received.
ATTACKER = r"""
import os, sys, zmq
from srt.grammar_pool.messages import RESULT_CODEC, TASK_CODEC, CompileResult
directory, count_path = sys.argv[1:3]
os.makedirs(directory, exist_ok=True)
os.chmod(directory, 0o755)
path = os.path.join(directory, "pool")
ctx, sock, ino, received = zmq.Context(), None, None, 0
def report(n):
    with open(count_path + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(count_path + ".tmp", count_path)
while True:
    try:
        current = os.lstat(path).st_ino
    except FileNotFoundError:
        current = None
    if sock is None or current != ino:
        if sock is not None:
            sock.close(0)
        os.makedirs(directory, exist_ok=True)  # the old service removed it when it stopped
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"ipc://{path}")
        ino = os.lstat(path).st_ino
        report(received)
    if sock.poll(20):
        frames = sock.recv_multipart()
        received += 1
        report(received)
        try:
            task = TASK_CODEC.decode(frames[-1])
            header = RESULT_CODEC.encode(CompileResult(task.kind, task.spec, "xgrammar", 0.0, 0.0, "xgrammar"))
            sock.send_multipart([frames[0], header, os.urandom(64)])
        except Exception:
            pass
"""


def _old_pool_dir(token: str, node_rank: int = 0) -> str:
    digest = hashlib.blake2b(token.encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"gramsync-grammar-{digest}-node{node_rank}")


def _pool_services(parent: psutil.Process) -> dict[int, psutil.Process]:
    """The compile pool services below ``parent``, by pid: those of the session's own Engine
    (``fp32_engine``) or servers too, when they run."""
    found = {}
    for p in parent.children(recursive=True):
        try:
            if "grammar_pool_node0" in " ".join(p.cmdline()):
                found[p.pid] = p
        except psutil.Error:
            pass
    return found


def _new_pool_service(parent: psutil.Process, before: dict) -> psutil.Process:
    """The one pool service that was not running before (None until it is)."""
    new = [p for pid, p in _pool_services(parent).items() if pid not in before]
    assert len(new) <= 1, f"more than one new pool service: {new}"
    return new[0] if new else None


def _unix_paths(proc: psutil.Process) -> list[str]:
    """Paths of ``proc``'s Unix sockets: a listener's, and those of connections it accepted."""
    return [c.laddr for c in proc.net_connections(kind="unix") if c.laddr]


@pytest.mark.timeout(300)
def test_pool_planted_at_the_old_path_gets_nothing(tmp_path, dirs, smollm2_dir, monkeypatch):
    import srt.entrypoints.engine as engine_mod
    from srt.entrypoints.engine import Engine
    from srt.transport.io_struct import PortArgs

    port_args = PortArgs.new(1)  # the server's own, known in advance so the attacker can aim
    old_dir = _old_pool_dir(port_args.ready_ipc)  # the token the old server used
    dirs.append(old_dir)
    count = tmp_path / "received"
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, old_dir, str(count)], cwd=ROOT,
                                start_new_session=True)
    try:
        wait_for(count.exists, 60, "the planted socket")
        monkeypatch.setattr(engine_mod, "new_port_args", lambda *a: port_args)
        monkeypatch.setenv("GRAMSYNC_GRAMMAR_COMPILE_WORKERS", "1")
        before = _pool_services(psutil.Process())  # a session-wide Engine's pool is not ours
        with Engine(model_path=smollm2_dir, grammar_backend="xgrammar", max_total_tokens=2048,
                    max_running_requests=4, log_level="warning", random_seed=0) as eng:
            out = eng.generate("Give me a person as JSON:", {
                "json_schema": json.dumps(PERSON), "max_new_tokens": 48, "temperature": 0})
            service = wait_for(lambda: _new_pool_service(psutil.Process(), before), 30, "the pool service")
            bound = _unix_paths(service)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), PERSON)
        assert count.read_text() == "0", "the planted socket received a task"
        # The real pool listened in a fresh private directory, removed when it stopped.
        assert bound, "the pool service had no bound socket"
        pool_dir = os.path.dirname(bound[0])
        assert os.path.basename(pool_dir).startswith("gramsync-grammar-") and pool_dir != old_dir
        wait_for(lambda: not os.path.exists(pool_dir), 30, "the pool to remove its directory")
        assert attacker.poll() is None  # it was there all along
    finally:
        attacker.kill()
        attacker.wait(10)


# ---- the node-leader collective and the single-node file store --------------------------
def _rank(world_rank: int, run_dir: str, out) -> None:
    """A rank of 2 DP groups x TP 2 on two 'nodes': joins over the single-node file store,
    then takes a value from its node's local rank 0."""
    try:
        import torch

        from distributed.node_share import share_from_node_leader
        from distributed.process_groups import destroy_process_groups, init_process_groups
        from srt.entrypoints.launcher import dist_config
        from srt.process_utils import die_with_parent

        die_with_parent()
        torch.set_num_threads(1)
        info = RankInfo.for_world_rank(world_rank, 2, 2, nnodes=2)
        cfg = dist_config(ServerArgs(tp_size=2, dp_size=2, dist_timeout=30), run_dir=run_dir)
        _, world = init_process_groups(info, cfg)
        value = share_from_node_leader(info, world, f"node{info.node_rank}" if info.local_rank == 0
                                       else f"not the leader {world_rank}")
        listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        share_from_node_leader(info, world, None)  # every rank has looked before any leaves
        destroy_process_groups()
        out.put((world_rank, cfg.init_method, value, listening))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((world_rank, "error", repr(e), []))


@pytest.mark.timeout(180)
def test_ranks_take_their_node_leaders_value_over_a_file_store(dirs):
    import multiprocessing as mp

    run_dir = _dir(dirs)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, run_dir, out), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, init_method, value, listening = out.get(timeout=150)
            results[rank] = (init_method, value, listening)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, (init_method, value, listening) in results.items():
        assert init_method == f"file://{run_dir}/dist_store", (rank, value)
        assert value == f"node{rank // 2}", (rank, value)
        # torch's TCPStore listens on every interface ('::'); gloo's own sockets do not.
        assert not [a for a in listening if a[0] in ("0.0.0.0", "::", "")], (rank, listening)


def test_dist_config_keeps_tcp_across_nodes_and_torchrun_store():
    from srt.entrypoints.launcher import dist_config

    multi = ServerArgs(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500")
    assert dist_config(multi, run_dir="/private").init_method == "tcp://10.0.0.1:29500"
    assert dist_config(ServerArgs(tp_size=2), "env://", "/private").init_method == "env://"
    assert dist_config(ServerArgs(tp_size=2), run_dir="/private").init_method == "file:///private/dist_store"


@pytest.mark.timeout(300)
def test_tp2_server_ranks_share_one_private_pool_and_no_store_port(tp2_server):
    """The real single-node launch: both ranks connect to one pool in a private directory
    (its handed-out path), and no process of the server listens on every interface (torch's
    TCPStore did, on '::')."""
    base, _ = tp2_server
    port = int(base.rsplit(":", 1)[1])
    frontend = next(psutil.Process(c.pid) for c in psutil.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    tree = [frontend, *frontend.children(recursive=True)]
    pools = [p for p in tree if "grammar_pool_node0" in " ".join(p.cmdline())]
    assert len(pools) == 1, [" ".join(p.cmdline()) for p in tree]
    # The listener and one accepted connection per rank carry the socket's path.
    wait_for(lambda: len(_unix_paths(pools[0])) == 3, 60, "both ranks to connect to the pool")
    pool_dir = os.path.dirname(_unix_paths(pools[0])[0])
    assert os.path.basename(pool_dir).startswith("gramsync-grammar-") and pool_dir_problem(pool_dir) is None
    wildcard = [(p.pid, c.laddr) for p in tree for c in p.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::", "")]
    assert not wildcard

