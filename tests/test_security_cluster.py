"""The cluster sockets of a multi-node server, attacked from the same network (loopback).

Node 0 of a two-node TP=2 server (the setup of the security report) is probed on EVERY TCP
port its processes listen on -- first while it waits for node 1, then while both serve --
with a pickled canary whose ``__reduce__`` would create a file: sent as a plain ZMQ
message, as a ZMQ message over CURVE with the wrong secret, and as raw TCP bytes. The
canary must never run and the server must keep serving. A peer WITH the secret that sends
a pickle, garbage or a message of the wrong type is dropped too (and counted).
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import uuid

import httpx
import psutil
import pytest
import zmq

from test_multi_rank_server import (
    _alive, _descendants, _free_port, _generate, _launch_cmd, _popen, _stop, _tail, _wait_healthy,
    _wait_until,
)
from srt.transport.io_struct import BatchTokenOut, FRONTEND_INPUT_CODEC, SCHEDULER_INPUT_CODEC, AbortReq
from srt.transport.zmq_transport import ZmqTransport
from srt.security.cluster_secret import CurveKeys

SECRET = "security-test-secret-" + uuid.uuid4().hex
pytestmark = pytest.mark.timeout(300)


class Canary:
    """Unpickling this creates ``path``: proof that bytes from the network were executed."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _listening_ports(procs: list[psutil.Process]) -> dict[int, int]:
    """port -> pid for every TCP socket in LISTEN state held by ``procs``."""
    ports = {}
    for p in procs:
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    ports[c.laddr.port] = p.pid
        except psutil.Error:
            continue
    return ports


def _tree(proc) -> list[psutil.Process]:
    return [psutil.Process(proc.pid), *_descendants(proc)]


def _attack(port: int, payload: bytes, wrong_keys: CurveKeys) -> None:
    """The canary as a plain ZMQ PUSH, over CURVE with the wrong secret, and as raw TCP."""
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send(payload, zmq.NOBLOCK) if plain.poll(0, zmq.POLLOUT) else None
        wrong = ctx.socket(zmq.PUSH)
        wrong.setsockopt(zmq.LINGER, 0)
        wrong.curve_serverkey = wrong_keys.server_public
        wrong.curve_publickey = wrong_keys.client_public
        wrong.curve_secretkey = wrong_keys.client_secret
        wrong.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # give both a chance to handshake (they must not succeed)
        for s in (plain, wrong):
            try:
                s.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                pass  # no peer accepted the connection: nothing can be delivered
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
            raw.sendall(payload)
            time.sleep(0.05)
    except OSError:
        pass  # the port refused or reset: nothing was executed either
    finally:
        ctx.destroy(0)


def _node_cmd(model_dir, http_port, dist_port, rank):
    return _launch_cmd(model_dir, http_port, "--tp-size", "2", "--nnodes", "2", "--node-rank",
                       str(rank), "--dist-init-addr", f"127.0.0.1:{dist_port}")


def test_node0_ports_never_execute_network_bytes(tmp_path, tiny_dir):
    canary = tmp_path / "canary-executed"
    payload = pickle.dumps(Canary(str(canary)))
    wrong_keys = CurveKeys.from_secret("not-the-cluster-secret-" + "x" * 32)
    http_port, dist_port = _free_port(), _free_port()
    env = {"GRAMSYNC_CLUSTER_SECRET": SECRET}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    node0 = _popen(_node_cmd(tiny_dir, http_port, dist_port, 0), logs[0], env)
    nodes, group = [node0], []
    base = f"http://127.0.0.1:{http_port}"
    try:
        # 1. While node 0 waits for node 1: its launcher's ready socket is open.
        # Once rank 0 hosts torch's TCPStore (attacked too), every socket of the waiting
        # node is bound.
        _wait_until(lambda: dist_port in _listening_ports(_tree(node0)), 90, "node 0's TCPStore")
        time.sleep(0.5)
        waiting = _listening_ports(_tree(node0))
        assert len(waiting) >= 2, waiting  # the launcher's ready socket and the TCPStore
        for port in waiting:
            _attack(port, payload, wrong_keys)
        time.sleep(1.0)
        assert not canary.exists(), "a pickle sent to node 0 was executed"
        assert node0.poll() is None, _tail(logs[0])

        # 2. Node 1 joins: the server works, then every port of node 0 is attacked again.
        nodes.append(_popen(_node_cmd(tiny_dir, http_port, dist_port, 1), logs[1], env))
        _wait_healthy(node0, base, logs[0])
        group = [p for n in nodes for p in _tree(n)]
        serving = _listening_ports(_tree(node0))
        # HTTP, the frontend's input, the entry rank's input, the TCPStore, gloo's listeners.
        assert len(serving) >= 4 and {http_port, dist_port} <= set(serving), serving
        for port in serving:
            _attack(port, payload, wrong_keys)
        time.sleep(1.0)
        assert not canary.exists(), "a pickle sent to node 0 was executed"
        assert all(n.poll() is None for n in nodes), _tail(logs[0]) + _tail(logs[1])
        out = _generate(base, "The capital of France is", max_new_tokens=8, temperature=0)
        assert out["meta_info"]["finish_reason"]["type"] == "length", out
        log0 = _tail(logs[0], 200000)
        assert "refused a handshake" in log0, log0[-3000:]  # counted and logged

        # 3. A peer WITH the secret still cannot run code or confuse a process: a pickle,
        #    garbage and wrong-type messages are dropped and counted, and serving goes on.
        frontend = next(p for p in group if "gramsync::frontend" in " ".join(p.cmdline()))
        front_ports = {c.laddr.port for c in frontend.net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN} - {http_port}
        sched_ports = {c.raddr.port for c in frontend.net_connections(kind="tcp")
                       if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in serving
                       and c.raddr.port not in front_ports | {http_port}}
        assert len(front_ports) == 1 and len(sched_ports) == 1, (front_ports, sched_ports, serving)
        insider = ZmqTransport(CurveKeys.from_secret(SECRET), "test insider")
        try:
            to_front = insider.connect(zmq.PUSH, f"tcp://127.0.0.1:{front_ports.pop()}")
            to_sched = insider.connect(zmq.PUSH, f"tcp://127.0.0.1:{sched_ports.pop()}")
            wrong_type_for_front = SCHEDULER_INPUT_CODEC.encode(AbortReq("nobody"))
            wrong_type_for_sched = FRONTEND_INPUT_CODEC.encode(BatchTokenOut((), (), (), (), ()))
            for sock, wrong in ((to_front, wrong_type_for_front), (to_sched, wrong_type_for_sched)):
                for msg in (payload, b"\x00garbage\xff", wrong):
                    sock.send(msg)
            info_headers = {}
            _wait_until(lambda: httpx.get(base + "/get_server_info", headers=info_headers, timeout=5)
                        .json()["num_dropped_messages"] >= 3, 20, "the frontend to count 3 drops")
            _wait_until(lambda: _tail(logs[0], 200000).count("not a valid gramsync message") >= 6, 20,
                        "the scheduler and frontend to log 6 drops")
        finally:
            insider.close()
        assert not canary.exists(), "a pickle from an authenticated peer was executed"
        out2 = _generate(base, "The capital of France is", max_new_tokens=8, temperature=0)
        assert out2["output_ids"] == out["output_ids"]  # same greedy output: nothing disturbed
        assert all(n.poll() is None for n in nodes)
    finally:
        for n in nodes:
            _stop(n, group)
    _wait_until(lambda: not any(_alive(p) for p in group), 15, "every process of both nodes to exit")


def test_nodes_without_the_secret(tmp_path, tiny_dir):
    """A worker node with no secret exits at once with instructions; node 0 with none
    generates one and prints how to pass it to the other nodes."""
    env = {k: v for k, v in os.environ.items() if k != "GRAMSYNC_CLUSTER_SECRET"}
    import subprocess
    import sys

    from conftest import ROOT

    dist = f"127.0.0.1:{_free_port()}"
    r = subprocess.run([sys.executable, "launch.py", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                        "--dist-init-addr", dist], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert "GRAMSYNC_CLUSTER_SECRET" in r.stderr and "--cluster-secret-file" in r.stderr, r.stderr

    env["GRAMSYNC_CACHE_DIR"] = str(tmp_path / "cache")
    log = tmp_path / "node0.log"
    node0 = _popen([sys.executable, "launch.py", "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                    "--dist-init-addr", dist, "--port", str(_free_port()),
                    "--model-path", tiny_dir], log, {"GRAMSYNC_CACHE_DIR": env["GRAMSYNC_CACHE_DIR"],
                                                        "GRAMSYNC_CLUSTER_SECRET": ""})
    try:
        secret_file = tmp_path / "cache" / "cluster_secret"
        _wait_until(lambda: secret_file.exists() and "GRAMSYNC_CLUSTER_SECRET=" in _tail(log), 60,
                    "node 0 to generate and print a secret")
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32 and f"GRAMSYNC_CLUSTER_SECRET={secret}" in _tail(log)
        assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    finally:
        _stop(node0, _tree(node0) if node0.poll() is None else [])


def test_torchrun_script_requires_the_secret():
    """scripts/torchrun_multinode.sh refuses a multi-node start without a shared secret."""
    import subprocess

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items()
           if k not in ("GRAMSYNC_CLUSTER_SECRET", "GRAMSYNC_CLUSTER_SECRET_FILE")}
    env.update(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", NPROC_PER_NODE="1")
    r = subprocess.run(["bash", "scripts/torchrun_multinode.sh", "--tp-size", "2"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "GRAMSYNC_CLUSTER_SECRET" in r.stderr and "token_hex" in r.stderr, r.stderr
