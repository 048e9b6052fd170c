"""The bitmap grammar agreement over real gloo: 4 spawned ranks on loopback (a hard
deadline, every process joined or killed; see ``test_distributed.run_world``).

Each rank gets its own ready set and failed messages for queue lengths that cross the
64-bit word boundaries; every rank must return the same (intersection, union) with the
lowest rank's message, and the no-failure path must be one all_reduce and nothing else.
"""
from __future__ import annotations

import random

import pytest

from distributed.grammar_agreement import bitmap_words, encode, positions
from distributed.parallel_state import SINGLE_RANK, TPGroup
from test_distributed import run_world

TP = 4
QUEUE_LENS = (0, 1, 31, 62, 63, 64, 65, 127, 128, 200)
KINDS = ("none", "ready_only", "all_ready", "failures", "ready_vs_failed", "shared_failure")


def _inputs(kind: str, n: int, rank: int, seed: int) -> tuple[set[int], dict[int, str]]:
    """Rank ``rank``'s local (ready, failed) for one case: deterministic, so the parent
    recomputes every rank's inputs for the oracle."""
    rng = random.Random(f"{kind}/{n}/{seed}/{rank}")
    common = random.Random(f"{kind}/{n}/{seed}")  # the same on every rank
    ready = {i for i in range(n) if rng.random() < 0.8}
    if kind == "none":
        return set(), {}
    if kind == "all_ready":
        return set(range(n)), {}
    if kind == "ready_only":
        return ready, {}
    if kind == "failures":  # each rank fails its own few, with its own messages
        failed = {i: f"rank{rank}: bad grammar {i}" for i in range(n) if rng.random() < 0.1}
        return ready - failed.keys(), failed
    shared = common.randrange(n) if n else None
    if kind == "ready_vs_failed":  # ready on ranks 0-2, failed on rank 3 only
        if shared is None:
            return set(), {}
        return (ready | {shared}, {}) if rank < TP - 1 else (ready - {shared}, {shared: "rank3 only"})
    # shared_failure: every rank but 0 fails the same index with a rank-specific message;
    # rank 0 times it out (a different text): the lowest rank's message must win everywhere.
    if shared is None:
        return ready, {}
    return ready - {shared}, {shared: f"timed out on rank {rank}" if rank == 0 else f"rank{rank} error"}


def _cases():
    return [(kind, n, seed, queue_len) for kind in KINDS for n in QUEUE_LENS for seed in (0, 1)
            for queue_len in (n, None)]


def _oracle(per_rank: list[tuple[set[int], dict[int, str]]]) -> tuple[set[int], dict[int, str]]:
    """The previous all_gather_object semantics, computed directly."""
    failed: dict[int, str] = {}
    for _, f in per_rank:
        for i, m in f.items():
            failed.setdefault(i, m)
    return set.intersection(*(r for r, _ in per_rank)) - failed.keys(), failed


def _worker(info, tp: TPGroup, world, cases) -> list:
    import torch.distributed as dist

    from distributed.grammar_agreement import agree_on_grammar_status

    calls = {"all_reduce": 0, "all_gather_object": 0}
    for name in calls:  # count the collectives each case makes
        real = getattr(dist, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        setattr(dist, name, counted)
    import torch

    word = torch.zeros(1, dtype=torch.int64)  # the GrammarManager's reused one-word buffer
    out = []
    for kind, n, seed, queue_len in cases:
        ready, failed = _inputs(kind, n, info.tp_rank, seed)
        before = dict(calls)
        got = agree_on_grammar_status(ready, failed, tp, queue_len=queue_len)
        counts = {k: calls[k] - before[k] for k in calls}
        out.append((got, counts, agree_on_grammar_status(ready, failed, tp, queue_len=queue_len, word=word)))
    return out


@pytest.mark.timeout(150)
def test_bitmap_agreement_matches_intersection_union_on_every_rank():
    cases = _cases()
    results = run_world(_worker, TP, 1, cases, deadline_s=120)
    for c, (kind, n, seed, queue_len) in enumerate(cases):
        per_rank = [_inputs(kind, n, r, seed) for r in range(TP)]
        expected = _oracle(per_rank)
        where = f"{kind} n={n} seed={seed} queue_len={queue_len}"
        for r in range(TP):
            got, calls, got_in_word = results[r][c]
            assert got == expected, f"{where}: rank {r} got {got}, expected {expected}"
            assert got_in_word == expected, f"{where}: rank {r} through the reused word: {got_in_word}"
            any_failed = any(f for _, f in per_rank)
            fits = queue_len is not None or all(i < 63 for rd, _ in per_rank for i in rd)
            # One all_reduce always; the message exchange only after a failure (or an
            # index past the default one-word bitmap).
            assert calls == {"all_reduce": 1, "all_gather_object": int(any_failed or not fits)}, where
    # The cases really exercised both paths and rank-specific messages.
    assert any(results[0][c][0][1] for c in range(len(cases)))
    shared = [c for c, case in enumerate(cases) if case[0] == "shared_failure" and case[1]]
    assert all("timed out on rank 0" in results[3][c][0][1].values() for c in shared)


@pytest.mark.parametrize("n,words", [(None, 1), (0, 1), (1, 1), (63, 1), (64, 2), (127, 2), (128, 3), (200, 4)])
def test_bitmap_words_pad_to_whole_words(n, words):
    assert bitmap_words(n) == words


def test_encode_decode_round_trip_and_fast_flag():
    ready = {0, 5, 62, 63, 126}
    bits = encode(ready, {}, 2)
    assert bits & 1 and positions(bits) == ready
    assert bits < 1 << 128  # fits two words
    assert encode(ready, {}, 1) == 0  # 63+ does not fit one word: slow path
    assert encode({1}, {2: "bad"}, 1) == 0  # so does any failure
    assert encode({-1}, {}, 1) == 0  # and a bad index
    assert encode(set(), {}, 4) == 1 and positions(1) == set()


def test_single_rank_needs_no_group():
    from distributed.grammar_agreement import agree_on_grammar_status

    assert agree_on_grammar_status({0, 1}, {1: "x"}, SINGLE_RANK, queue_len=2) == ({0}, {1: "x"})
