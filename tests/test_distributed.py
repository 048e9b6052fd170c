"""Multi-rank serving over real torch.distributed (gloo on CPU): rank layout, process
groups, the collectives and agreement points in ``distributed/``, and TP head padding
(a 2-rank tiny Llama whose heads do not split evenly must match TP=1).

Every multi-rank check runs in real spawned processes with a hard deadline; a rank that
fails reports its traceback through a queue and the whole world is killed at once, so a
broken collective can never hang the suite or leave processes behind.
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import pytest
import torch

from distributed.parallel_state import SINGLE_RANK, RankInfo, TPGroup, local_world_ranks

WORLD_DEADLINE_S = 60  # per spawned world: start-up (imports) + work


# -- spawning ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank: int, tp: int, dp: int, port: int, args: tuple, out) -> None:
    """Child process: join the world, run ``fn``, report ``(rank, ok, payload)``."""
    try:
        from srt.process_utils import die_with_parent

        die_with_parent()  # never outlive pytest, even if it is SIGKILLed
        torch.set_num_threads(1)
        from distributed.process_groups import DistConfig, destroy_process_groups, init_process_groups

        info = RankInfo.for_world_rank(rank, tp, dp)
        tp_group, world = init_process_groups(info, DistConfig(f"tcp://127.0.0.1:{port}", "gloo", 30))
        try:
            result = fn(info, tp_group, world, *args)
        finally:
            destroy_process_groups()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, False, traceback.format_exc()))


def run_world(fn, tp: int, dp: int, *args, deadline_s: float = WORLD_DEADLINE_S,
              procs_out: list | None = None) -> dict:
    """Run ``fn(rank_info, tp_group, world_group, *args)`` on ``tp * dp`` spawned ranks and
    return ``{world_rank: result}``. Raises on the first rank error or at the deadline;
    every child is joined or killed before this returns."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, tp, dp, port, args, out), daemon=True)
             for r in range(tp * dp)]
    if procs_out is not None:
        procs_out.extend(procs)
    for p in procs:
        p.start()
    results, errors = {}, {}
    end = time.monotonic() + deadline_s
    try:
        while len(results) + len(errors) < len(procs):
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # a rank died without reporting (segfault, OOM kill)
                    errors[-1] = f"rank process exited with {dead}"
                    break
                continue
            (results if ok else errors)[rank] = payload
            if not ok:
                break  # the others would block in a collective: stop now
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    if errors:
        raise AssertionError("rank failure:\n" + "\n".join(f"[rank {r}] {e}" for r, e in sorted(errors.items())))
    if len(results) < len(procs):
        raise AssertionError(f"only ranks {sorted(results)} of {len(procs)} finished within {deadline_s} s")
    assert not any(p.is_alive() for p in procs)
    return results


def _failing_worker(info: RankInfo, tp: TPGroup, world) -> None:
    import torch.distributed as dist

    if info.tp_rank == 1:
        raise RuntimeError("rank 1 broke before the collective")
    dist.barrier(group=tp.cpu_group)  # never completes: rank 1 is gone


@pytest.mark.timeout(60)
def test_run_world_reports_a_rank_failure_fast_and_leaves_no_process():
    procs: list = []
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 broke before the collective"):
        run_world(_failing_worker, 2, 1, procs_out=procs)
    assert time.monotonic() - t0 < 25  # not the 30 s gloo timeout of the stuck rank 0
    assert len(procs) == 2 and not any(p.is_alive() for p in procs)


# -- rank layout (no processes) ----------------------------------------------------------
def test_rank_layout_tp2_dp2_two_nodes():
    got = [RankInfo.for_world_rank(r, tp_size=2, dp_size=2, nnodes=2) for r in range(4)]
    assert [(i.tp_rank, i.dp_rank, i.local_rank, i.node_rank) for i in got] == [
        (0, 0, 0, 0), (1, 0, 1, 0), (0, 1, 0, 1), (1, 1, 1, 1)]
    assert all((i.tp_size, i.dp_size, i.world_size, i.nnodes) == (2, 2, 4, 2) for i in got)
    assert [i.world_rank for i in got] == [0, 1, 2, 3]
    assert [i.name for i in got] == ["DP0_TP0", "DP0_TP1", "DP1_TP0", "DP1_TP1"]
    assert [i.is_entry_rank for i in got] == [True, False, True, False]
    assert got[2].proc_title == "gramsync::scheduler_DP1_TP0"
    assert got[3].log_prefix == "[DP1 TP1]"
    # One node: local rank == world rank.
    one = [RankInfo.for_world_rank(r, 2, 2) for r in range(4)]
    assert [(i.local_rank, i.node_rank) for i in one] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    # RankInfo is frozen and picklable: it crosses the spawn boundary.
    import pickle

    assert pickle.loads(pickle.dumps(got[3])) == got[3]
    with pytest.raises(Exception):
        got[0].tp_rank = 1


@pytest.mark.parametrize("tp,dp,nnodes", [(3, 1, 2), (1, 3, 2), (2, 3, 4)])
def test_rank_layout_rejects_uneven_node_split(tp, dp, nnodes):
    with pytest.raises(ValueError, match=f"--nnodes {nnodes}"):
        RankInfo.for_world_rank(0, tp, dp, nnodes)


def test_local_world_ranks():
    assert local_world_ranks(2, 2, 2, 0) == range(0, 2)
    assert local_world_ranks(2, 2, 2, 1) == range(2, 4)
    assert local_world_ranks(4, 1, 1, 0) == range(0, 4)
    assert local_world_ranks(2, 3, 3, 2) == range(4, 6)
    # The nodes' ranks partition the world, in order.
    assert [r for n in range(4) for r in local_world_ranks(4, 2, 4, n)] == list(range(8))


def test_world_size_one_creates_no_process_group():
    import torch.distributed as dist

    from distributed.communication import tp_all_gather_last_dim, tp_all_reduce, tp_min_int
    from distributed.process_groups import DistConfig, init_process_groups
    from distributed.token_agreement import agree_on_sampled_ids

    # An unreachable address: joining would fail, so returning proves nothing was joined.
    tp, world = init_process_groups(RankInfo(), DistConfig("tcp://127.0.0.1:1", "gloo", 1))
    assert (tp, world) == (SINGLE_RANK, None)
    assert tp.is_single and tp.device_group is None and tp.cpu_group is None
    assert not dist.is_initialized()
    x = torch.arange(6.0).view(2, 3)
    assert tp_all_reduce(x, tp) is x and tp_all_gather_last_dim(x, tp) is x
    assert tp_min_int(7, tp) == 7
    ids = torch.tensor([5, 3, 9])
    agreed, mismatches = agree_on_sampled_ids(ids, tp)
    assert agreed is ids and mismatches == 0
    assert not dist.is_initialized()


# -- a world of 4: tp=2 x dp=2 -----------------------------------------------------------
def _sample_payload(dp_rank: int):
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import AbortReq, FinishReason, TokenizedGenerateReq

    return [
        TokenizedGenerateReq(f"dp{dp_rank}-a", (1, 2, 3), SamplingParams.from_dict(
            {"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]+", "stop": ["\n"]})),
        AbortReq(f"dp{dp_rank}-b", "client went away", 499),
        {"nested": [FinishReason("abort", message="ü" * 3, status_code=400), (dp_rank, None)],
         "big": list(range(10_000))},
    ]


def _world4_worker(info: RankInfo, tp: TPGroup, world, _unused=None) -> dict:
    import torch.distributed as dist

    from distributed.broadcast import broadcast_pyobj
    from distributed.communication import tp_all_gather_last_dim, tp_all_reduce, tp_min_int
    from distributed.token_agreement import agree_on_sampled_ids

    r = info.world_rank
    src = info.dp_rank * info.tp_size  # world rank of this DP group's entry rank
    res: dict = {"group": (tp.rank, tp.size, tp.is_single, tp.device_group is not None,
                           tp.cpu_group is not None, world is not None),
                 "cpu_group_rank": dist.get_rank(group=tp.cpu_group),
                 "cpu_group_size": dist.get_world_size(group=tp.cpu_group),
                 "device_group_rank": dist.get_rank(group=tp.device_group),
                 "shm": tp.shm is not None}  # each DP group's own shared-memory segment
    # tp_all_reduce: sums within the DP group only.
    x = torch.full((2, 3), float(r + 1))
    y = tp_all_reduce(x, tp)
    res["all_reduce"] = (y is x, y.tolist())
    # tp_all_gather_last_dim: each rank's shard, in TP rank order.
    shard = torch.tensor([[10.0 * r, 10.0 * r + 1]])
    res["all_gather"] = tp_all_gather_last_dim(shard, tp).tolist()
    # broadcast_pyobj from the group's entry rank: rich payload, then the empty fast path.
    payload = _sample_payload(info.dp_rank) if info.is_entry_rank else None
    got = broadcast_pyobj(payload, info.is_entry_rank, src, tp.cpu_group)
    res["broadcast"] = got == _sample_payload(info.dp_rank)
    res["broadcast_types"] = [type(o).__name__ for o in got]
    res["broadcast_empty"] = broadcast_pyobj([] if info.is_entry_rank else ["ignored"],
                                             info.is_entry_rank, src, tp.cpu_group)
    # Non-list falsy objects are real payloads, not the empty fast path.
    res["broadcast_falsy"] = broadcast_pyobj((None, 0, ()) if info.is_entry_rank else "x",
                                             info.is_entry_rank, src, tp.cpu_group)
    # Still in step after the fast path: the next broadcast is read correctly.
    res["broadcast_after"] = broadcast_pyobj(("after", info.dp_rank) if info.is_entry_rank else None,
                                             info.is_entry_rank, src, tp.cpu_group)
    # tp_min_int: the group minimum (e.g. KV-cache size profiled per rank).
    res["min_int"] = tp_min_int(1000 - 100 * r + 7 * info.tp_rank, tp)
    # agree_on_sampled_ids: element-wise MIN over the group; mismatches per rank.
    base = torch.tensor([50, 60, 70, 80, 90], dtype=torch.int64)
    mine = base.clone()
    if info.tp_rank == 0:
        mine[1] -= 5 + info.dp_rank  # rank 0 lower at 1
        mine[3] += 4  # rank 0 higher at 3
    else:
        mine[2] -= 1  # rank 1 lower at 2
        mine[4] -= 2 + info.dp_rank  # and at 4
    agreed, mismatches = agree_on_sampled_ids(mine, tp)
    res["agree"] = (agreed.tolist(), mismatches, mine.tolist(), agreed is mine, agreed.dtype == mine.dtype)
    # The grammar agreement over the real TP CPU group.
    from distributed.grammar_agreement import agree_on_grammar_status

    ready = {0, 1, 2} if info.tp_rank == 0 else {1, 2, 3}
    failed = {2: f"failed on {info.name}"} if info.tp_rank == 1 else {}
    res["grammar"] = agree_on_grammar_status(ready, failed, tp)
    return res


@pytest.fixture(scope="module")
def world4():
    return run_world(_world4_worker, 2, 2)


@pytest.mark.timeout(90)
def test_tp_groups_have_the_right_rank_and_size(world4):
    for r, res in world4.items():
        assert res["group"] == (r % 2, 2, False, True, True, True)
        assert res["cpu_group_rank"] == res["device_group_rank"] == r % 2
        assert res["cpu_group_size"] == 2
        assert res["shm"]  # so the sums and agreements below ran through shared memory


@pytest.mark.timeout(90)
def test_tp_all_reduce_sums_within_the_dp_group_only(world4):
    for r, res in world4.items():
        in_place, value = res["all_reduce"]
        assert in_place
        group_sum = (1 + 2) if r < 2 else (3 + 4)  # rank r contributes r + 1
        assert value == [[float(group_sum)] * 3] * 2


@pytest.mark.timeout(90)
def test_tp_all_gather_last_dim_concatenates_in_rank_order(world4):
    for r, res in world4.items():
        first = 2 * (r // 2)
        assert res["all_gather"] == [[10.0 * first, 10.0 * first + 1, 10.0 * (first + 1), 10.0 * (first + 1) + 1]]


@pytest.mark.timeout(90)
def test_broadcast_pyobj_from_each_group_entry_rank(world4):
    for r, res in world4.items():
        assert res["broadcast"], f"rank {r} got a different payload"
        assert res["broadcast_types"] == ["TokenizedGenerateReq", "AbortReq", "dict"]
        assert res["broadcast_empty"] == []
        assert res["broadcast_falsy"] == (None, 0, ())
        assert res["broadcast_after"] == ("after", r // 2)


@pytest.mark.timeout(90)
def test_tp_min_int_takes_the_group_minimum(world4):
    for r, res in world4.items():
        values = [1000 - 100 * w + 7 * (w % 2) for w in range(4)]
        assert res["min_int"] == min(values[2 * (r // 2): 2 * (r // 2) + 2])


@pytest.mark.timeout(90)
def test_agree_on_sampled_ids_takes_elementwise_min_and_counts_mismatches(world4):
    for r, res in world4.items():
        agreed, mismatches, mine, same_object, same_dtype = res["agree"]
        dp = r // 2
        assert agreed == [50, 60 - 5 - dp, 70 - 1, 80, 90 - 2 - dp]
        assert not same_object and same_dtype
        assert mismatches == sum(a != m for a, m in zip(agreed, mine))
        # TP0 sits above the minimum at rows 2, 3 and 4; TP1 only at row 1.
        assert mismatches == (3 if r % 2 == 0 else 1)
    assert world4[0]["agree"][0] != world4[2]["agree"][0]  # DP groups do not mix


@pytest.mark.timeout(90)
def test_grammar_agreement_per_tp_group(world4):
    for r, res in world4.items():
        ready, failed = res["grammar"]
        assert ready == {1}  # intersection {1, 2} minus the failed 2
        assert failed == {2: f"failed on DP{r // 2}_TP1"}


# -- TP head padding ---------------------------------------------------------------------
@pytest.mark.parametrize("tp,expected", [(1, (9, 3)), (2, (12, 4)), (3, (9, 3)), (4, (12, 4))])
def test_padded_heads_smollm2_shape(tp, expected):
    from srt.model_executor.model_config import ModelConfig

    cfg = ModelConfig(model_path="x", architecture="LlamaForCausalLM", hf_config=None,
                      vocab_size=300, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      context_len=128, eos_token_ids=(0,), tie_word_embeddings=True)
    heads, kv = cfg.padded_heads(tp)
    assert (heads, kv) == expected
    assert heads // kv == 9 // 3  # the query/KV grouping is unchanged
    assert cfg.num_kv_heads_per_rank(tp) * tp >= kv


def _Harness(model, cfg, tp_size: int, n_seqs: int):
    """test_model_parity's hand-built runner, with this rank's KV head count."""
    from test_model_parity import _Runner

    return _Runner(model, cfg, n_seqs, max_ctx=64, tp_size=tp_size)


PROMPTS = [[5, 17, 230, 4, 99, 150, 7, 8, 260], [1], [42, 43, 44, 45]]


def _run_tiny(model_dir: str, tp: TPGroup) -> list:
    """Logits of a prefill (all positions) and two greedy decode steps: [prefill, d1, d2]."""
    from srt.model_executor.forward_batch import ForwardMode
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import load_model

    cfg = ModelConfig.from_path(model_dir)
    model = load_model(cfg, tp, torch.float32, "cpu")
    h = _Harness(model, cfg, tp.size, len(PROMPTS))
    seqs = list(range(len(PROMPTS)))
    out = [h.step(ForwardMode.EXTEND, PROMPTS, seqs)]
    last = out[0][torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1]
    for _ in range(2):
        nxt = last.argmax(-1).tolist()
        last = h.step(ForwardMode.DECODE, [[t] for t in nxt], seqs)
        out.append(last)
    # Model internals worth checking: the padded shapes this rank was built with.
    attn = model.model.layers[0].self_attn
    return [o.numpy() for o in out] + [(attn.num_heads, attn.num_kv_heads)]


def _tiny_tp_worker(info: RankInfo, tp: TPGroup, world, model_dirs: list[str]) -> list:
    return [_run_tiny(d, tp) for d in model_dirs]


TINY_KINDS = {
    # 3 query heads / 1 KV head: TP=2 pads to 6/2 (a whole zero KV group on rank 1).
    "gqa-3q-1kv-untied": dict(num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False),
    # 3/3 (MHA) with q/k/v/o biases: TP=2 pads to 4/4; padded bias rows must be zero too.
    "mha-3q-3kv-tied-bias": dict(num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=True,
                                 attention_bias=True),
}


@pytest.mark.timeout(120)
def test_tp2_with_padded_heads_matches_tp1(tmp_path):
    import transformers as tf

    dirs = []
    for i, (kind, extra) in enumerate(TINY_KINDS.items()):
        torch.manual_seed(i)
        hf_cfg = tf.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96,
                                num_hidden_layers=2, max_position_embeddings=64,
                                initializer_range=0.1, rms_norm_eps=1e-6, **extra)
        model = tf.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        if extra.get("attention_bias"):
            with torch.no_grad():  # HF zero-inits biases; make them matter
                for layer in model.model.layers:
                    a = layer.self_attn
                    for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                        proj.bias.normal_(0, 0.5)
        d = tmp_path / kind
        model.save_pretrained(d, safe_serialization=True)
        assert any(f.endswith(".safetensors") for f in os.listdir(d))
        dirs.append(str(d))

    results = run_world(_tiny_tp_worker, 2, 1, dirs, deadline_s=100)
    for i, (kind, d) in enumerate(zip(TINY_KINDS, dirs)):
        ref = _run_tiny(d, TPGroup())
        heads = {"gqa-3q-1kv-untied": [(3, 1), (3, 1)], "mha-3q-3kv-tied-bias": [(2, 2), (2, 2)]}[kind]
        assert ref[-1] == ((3, 1) if kind.startswith("gqa") else (3, 3))
        for rank in (0, 1):
            got = results[rank][i]
            assert got[-1] == heads[rank], f"{kind}: rank {rank} built {got[-1]} heads"
            for step, (g, r) in enumerate(zip(got[:-1], ref[:-1])):
                assert g.shape == r.shape, f"{kind} step {step}: shape {g.shape} vs {r.shape}"
                err = abs(torch.from_numpy(g) - torch.from_numpy(r)).max().item()
                assert err < 1e-5, f"{kind} rank {rank} step {step}: max abs diff {err:.2e}"
