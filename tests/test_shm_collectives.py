"""The shared-memory TP collectives (distributed/shm_collectives.py) over real spawned
ranks: the same bits as gloo for every op and dtype, correct under many back-to-back ops of
changing shapes (the double buffer), gloo for what does not fit, agreement when one rank
cannot or will not share memory, a timeout that names the missing rank, and nothing left
in /dev/shm. The scheduler-level proof (TP=2 greedy ids equal TP=1, lock-step batch logs)
is in test_multi_rank_server.py, whose servers use this path by default; the 4-rank world
of test_distributed.py runs its sums and agreements through one segment per DP group."""
from __future__ import annotations

import glob

import pytest
import torch

from distributed.parallel_state import RankInfo, TPGroup
from distributed.shm_collectives import SLOT_BYTES, shm_supported
from test_distributed import run_world

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm_supported(), reason="shared-memory collectives are x86-64 only")]


def _tensor(rank: int, i: int, shape, dtype) -> torch.Tensor:
    """What rank ``rank`` contributes to op ``i``: every rank can recompute anyone's."""
    g = torch.Generator().manual_seed(1000 * i + rank)
    if dtype == torch.int64:
        return torch.randint(0, 50_000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


SHAPES = [(1, 576), (3, 576), (64, 576), (1, 24576), (8, 24576)]
DTYPES = [torch.float32, torch.bfloat16]


def _equal_to_gloo(info: RankInfo, tp: TPGroup) -> dict:
    import torch.distributed as dist

    out = {"sum": [], "gather": [], "min": []}
    for i, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES):
        x = _tensor(info.tp_rank, i, shape, dtype)
        via_gloo = x.clone()
        dist.all_reduce(via_gloo, group=tp.device_group)
        via_shm = x.clone()
        assert tp.shm.all_reduce(via_shm)
        out["sum"].append(torch.equal(via_gloo, via_shm))
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x, group=tp.device_group)
        out["gather"].append(torch.equal(torch.cat(parts, dim=-1), tp.shm.all_gather_last_dim(x)))
    ids = _tensor(info.tp_rank, 99, (16,), torch.int64)
    via_gloo = ids.clone()
    dist.all_reduce(via_gloo, op=dist.ReduceOp.MIN, group=tp.device_group)
    via_shm = ids.clone()
    assert tp.shm.all_reduce(via_shm, op="min")
    out["min"].append(torch.equal(via_gloo, via_shm))
    return out


def _wrong_in_many_ops(tp: TPGroup, n_ops: int) -> int:
    """Back-to-back ops of changing shapes, each checked against the sum every rank can
    compute itself: a slot overwritten before a peer read it would show here."""
    from distributed.communication import tp_all_gather_last_dim, tp_all_reduce

    wrong = 0
    for i in range(n_ops):
        shape = [(1, 576), (4, 576), (1, 1536), (2, 24576)][i % 4]
        x = _tensor(tp.rank, i, shape, torch.float32)
        if i % 5 == 4:
            want = torch.cat([_tensor(r, i, shape, torch.float32) for r in range(tp.size)], dim=-1)
            wrong += not torch.equal(tp_all_gather_last_dim(x, tp), want)
        else:
            want = _tensor(0, i, shape, torch.float32)
            for r in range(1, tp.size):
                want = want + _tensor(r, i, shape, torch.float32)
            wrong += not torch.equal(tp_all_reduce(x, tp), want)
    return wrong


def _oversize(tp: TPGroup) -> tuple:
    from distributed.communication import tp_all_reduce

    big = torch.full((SLOT_BYTES // 4 + 1,), float(tp.rank + 1))
    untouched = not tp.shm.all_reduce(big.clone()) and tp.shm.all_gather_last_dim(big) is None
    summed = tp_all_reduce(big, tp)  # gloo takes it
    return untouched, bool((summed == 3.0).all())


def _unwilling(tp: TPGroup, unwilling_rank: int) -> bool:
    from distributed.shm_collectives import create_shm_collectives

    shm = create_shm_collectives(tp.rank, tp.size, tp.cpu_group, 10, wanted=tp.rank != unwilling_rank)
    return shm is None


def _missing_rank(tp: TPGroup) -> str:
    """Last (it leaves the group's new segment out of step): rank 1 never joins the op."""
    import time

    from distributed.shm_collectives import create_shm_collectives

    shm = create_shm_collectives(tp.rank, tp.size, tp.cpu_group, timeout_s=1.0)
    if tp.rank == 1:
        time.sleep(4)  # rank 0 must give up, not hang
        return "absent"
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(4))
    except RuntimeError as e:
        return f"{time.monotonic() - t0:.1f} {e}"
    return "no error"


def _compiled_collectives(tp: TPGroup) -> dict:
    from distributed.communication import tp_all_gather_last_dim, tp_all_reduce, without_peers

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = tp_all_reduce(x * 2.0, tp) + 1.0
        return y, tp_all_gather_last_dim(y * 3.0, tp)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = _tensor(tp.rank, 7, (3, 576), torch.float32)
    if tp.rank == 0:  # alone: rank 1 is not in this call, and it must not wait for it
        with without_peers(tp):
            local_alone = torch.equal(compiled(x)[0], x * 2.0 + 1.0)
    else:
        local_alone = True
    before = tp.shm.seq
    got = compiled(x)
    via_segment = tp.shm.seq == before + 2
    want = step(x)
    return {"reduce_equal": torch.equal(got[0], want[0]), "gather_equal": torch.equal(got[1], want[1]),
            "via_segment": via_segment, "local_alone": local_alone}


def _agreement(tp: TPGroup) -> list:
    from distributed.compile_agreement import agree_on_compiled_steps

    mine = {0: [[2, 2], [2, 1], [2, 2]], 1: [[0, 2], [2, 2], [2, 2]]}[tp.rank]
    return [agree_on_compiled_steps(states, tp) for states in mine]


def _tp2_worker(info: RankInfo, tp: TPGroup, world) -> dict:
    """Every TP=2 check in one world (a spawned world costs seconds of imports)."""
    return {"has_shm": tp.shm is not None, "gloo": _equal_to_gloo(info, tp),
            "wrong": _wrong_in_many_ops(tp, 400), "oversize": _oversize(tp),
            "compiled": _compiled_collectives(tp), "agreement": _agreement(tp),
            "unwilling": [_unwilling(tp, r) for r in (0, 1)], "missing": _missing_rank(tp)}


@pytest.fixture(scope="module")
def tp2():
    before = set(glob.glob("/dev/shm/gramsync-tp-*"))
    results = run_world(_tp2_worker, 2, 1)
    return results, set(glob.glob("/dev/shm/gramsync-tp-*")) - before


def test_one_machine_cpu_tp_group_uses_shared_memory_and_leaves_nothing_in_dev_shm(tp2):
    results, left = tp2
    assert all(res["has_shm"] for res in results.values())
    assert not left, f"segments left behind: {left}"


def test_same_bits_as_gloo_for_every_op_and_dtype(tp2):
    for rank, res in tp2[0].items():
        g = res["gloo"]
        assert all(g["sum"]) and all(g["gather"]) and all(g["min"]), (rank, g)


def test_back_to_back_ops_of_changing_shapes_stay_exact(tp2):
    assert {r: res["wrong"] for r, res in tp2[0].items()} == {0: 0, 1: 0}


def _tp3_worker(info: RankInfo, tp: TPGroup, world) -> int:
    return _wrong_in_many_ops(tp, 200)


def test_three_ranks_stay_exact():
    assert run_world(_tp3_worker, 3, 1) == {0: 0, 1: 0, 2: 0}


def test_tensors_larger_than_a_slot_go_through_gloo(tp2):
    assert {r: res["oversize"] for r, res in tp2[0].items()} == {0: (True, True), 1: (True, True)}


def test_one_unwilling_rank_keeps_the_whole_group_on_gloo(tp2):
    assert {r: res["unwilling"] for r, res in tp2[0].items()} == {0: [True, True], 1: [True, True]}


def test_a_missing_rank_is_a_timeout_naming_it(tp2):
    seconds, message = tp2[0][0]["missing"].split(" ", 1)
    assert 1.0 <= float(seconds) < 3.0 and "TP rank 1 did not reach" in message, tp2[0][0]["missing"]


def test_a_tp_group_spanning_nodes_keeps_gloo():
    from distributed.process_groups import _tp_group_on_one_node

    assert _tp_group_on_one_node(RankInfo.for_world_rank(1, 2, 2, nnodes=2))
    assert not _tp_group_on_one_node(RankInfo.for_world_rank(1, 4, 1, nnodes=2))
    assert not _tp_group_on_one_node(RankInfo.for_world_rank(0, 2, 1, nnodes=2))
    assert _tp_group_on_one_node(RankInfo.for_world_rank(3, 4, 1, nnodes=1))


def test_compiled_steps_call_the_segment_through_custom_ops(tp2):
    """A torch.compile'd (Inductor, fullgraph: no graph break) function over the layers'
    collectives gives the eager bits at TP=2; its ops reach the segment, whose operation
    count moved; ``without_peers`` keeps one rank's call local without its peer."""
    for rank, res in tp2[0].items():
        assert res["compiled"] == {"reduce_equal": True, "gather_equal": True, "via_segment": True,
                                   "local_alone": True}, (rank, res["compiled"])


def test_ranks_agree_on_the_compiled_steps_by_their_minimum(tp2):
    """distributed/compile_agreement.py: pending anywhere -> pending; failed anywhere -> unused."""
    assert {r: res["agreement"] for r, res in tp2[0].items()} == {
        0: [[0, 2], [2, 1], [2, 2]], 1: [[0, 2], [2, 1], [2, 2]]}
