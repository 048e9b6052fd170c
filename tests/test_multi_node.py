"""Multi-node launches, with the "nodes" on loopback: every process of each node is real,
and the nodes talk only over TCP (torch.distributed rendezvous and collectives, ZMQ).

- SGLang-style: ``launch.py --nnodes 2 --node-rank K --dist-init-addr 127.0.0.1:P`` on two
  "nodes" with one DP group each; node 1's entry rank is reached over TCP. Killing node 0
  makes node 1 exit non-zero within seconds (peer liveness), with no process left.
- torchrun: ``--nnodes 2 --node-rank K --nproc-per-node 1`` with one TP=2 group spanning
  both "nodes", or one pipeline of two stages (``--pp-size 2``: each node a stage, the
  entry rank -- the last stage's -- on node 1, reached over TCP); a constrained request is
  served end to end.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from test_multi_rank_server import (
    _alive, _batches, _descendants, _free_port, _generate, _launch_cmd, _popen, _stop, _tail,
    _wait_healthy, _wait_until,
)


# Every node holds the same cluster secret (as the SLURM / torchrun scripts arrange).
CLUSTER_ENV = {"GRAMSYNC_CLUSTER_SECRET": "test-cluster-secret-" + "0123456789abcdef" * 2}


def _node_cmd(model_dir: str, http_port: int, dist_port: int, node_rank: int) -> list[str]:
    return _launch_cmd(model_dir, http_port, "--dp-size", "2", "--nnodes", "2",
                       "--node-rank", str(node_rank), "--dist-init-addr", f"127.0.0.1:{dist_port}")


@pytest.mark.timeout(240)
def test_two_nodes_without_torchrun(tmp_path, tiny_dir):
    http_port, dist_port = _free_port(), _free_port()
    env = {"GRAMSYNC_BATCH_LOG_DIR": str(tmp_path / "batches"), **CLUSTER_ENV}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_popen(_node_cmd(tiny_dir, http_port, dist_port, k), logs[k], env) for k in (0, 1)]
    base = f"http://127.0.0.1:{http_port}"
    group: list[psutil.Process] = []
    try:
        _wait_healthy(nodes[0], base, logs[0])
        group = [p for n in nodes for p in (psutil.Process(n.pid), *_descendants(n))]
        rids = [f"mn-{uuid.uuid4().hex[:8]}-{i}" for i in range(4)]
        for i, rid in enumerate(rids):  # round robin: two requests per DP group
            params = {"max_new_tokens": 12, "temperature": 0}
            if i % 2:
                params["regex"] = "[0-9]{3}-[0-9]{4}"
            out = _generate(base, "A phone number:", rid=rid, **params)
            if i % 2:
                assert re.fullmatch("[0-9]{3}-[0-9]{4}", out["text"]), out
                assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        served = {dp: {r for _, b in _batches(env["GRAMSYNC_BATCH_LOG_DIR"], f"DP{dp}_TP0") for r in b}
                  for dp in (0, 1)}
        assert served[0] and served[1], served  # node 1's group (DP1) served over TCP
        assert served[0] | served[1] >= set(rids)

        # Node 0 dies abruptly (its launcher and, via the parent-death signal, its ranks):
        # node 1's rank notices the lost peer and its node exits non-zero.
        nodes[0].send_signal(signal.SIGKILL)
        try:
            code = nodes[1].wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still running 30 s after node 0 died:\n{_tail(logs[1])}")
        log1 = _tail(logs[1], 20000)
        assert code == 1, log1
        assert "lost contact with another rank" in log1, log1
        assert "scheduler rank DP1_TP0" in log1, log1
        _wait_until(lambda: not any(_alive(p) for p in group), 15, "every process of both nodes to exit")
    finally:
        for n in nodes:
            _stop(n, group)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout, ranks", [
    (("--tp-size", "2"), ["DP0_TP0", "DP0_TP1"]),
    (("--pp-size", "2"), ["DP0_PP0_TP0", "DP0_PP1_TP0"]),
], ids=["tp2", "pp2"])
def test_torchrun_two_nodes_one_group(tmp_path, tiny_dir, layout, ranks):
    http_port, master_port = _free_port(), _free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = []
    for k in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "--max-restarts", "0", *_launch_cmd(tiny_dir, http_port, *layout)[1:]]
        nodes.append(_popen(cmd, logs[k], CLUSTER_ENV))
    base = f"http://127.0.0.1:{http_port}"
    group: list[psutil.Process] = []
    try:
        _wait_healthy(nodes[0], base, logs[0])
        group = [p for n in nodes for p in (psutil.Process(n.pid), *_descendants(n))]
        every = [" ".join(p.cmdline()).strip() for p in group if "gramsync::" in " ".join(p.cmdline())]
        titles = sorted(t for t in every if "grammar_compile" not in t)
        # One grammar compile pool per node (each node's ranks share theirs).
        assert titles == ["gramsync::frontend", "gramsync::grammar_pool_node0", "gramsync::grammar_pool_node1",
                          *(f"gramsync::scheduler_{r}" for r in ranks)], titles
        def workers_up() -> bool:  # forked once the pool has built its backend
            titles = [" ".join(p.cmdline()) for n in nodes for p in _descendants(n)]
            return all(any(t.startswith(f"gramsync::grammar_compile_node{k}_") for t in titles) for k in (0, 1))
        deadline = time.monotonic() + 30
        while not workers_up():
            assert time.monotonic() < deadline, "no compile workers on some node"
            time.sleep(0.2)
        schema = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}'
        out = _generate(base, "A JSON object with a number:", max_new_tokens=24, temperature=0,
                        json_schema=schema)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert isinstance(json.loads(out["text"])["n"], int), out
        nodes[0].send_signal(signal.SIGTERM)  # torchrun agent of node 0: the job ends
        for k, n in enumerate(nodes):
            try:
                n.wait(60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"torchrun node {k} still running after node 0 stopped:\n{_tail(logs[k])}")
        _wait_until(lambda: not any(_alive(p) for p in group), 15, "every process of both nodes to exit")
    finally:
        for n in nodes:
            _stop(n, group)
