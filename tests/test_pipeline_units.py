"""Pipeline parallelism's pieces, in one process: the rank layout, the stage split, the
micro-batch split (checked numerically: two stages over micro-batches give the whole
model's logits), flag validation, and the grammar agreement's silence with nothing
pending. The real-process tests are in test_pipeline_parallel.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from constrained.grammar_manager import GrammarManager
from distributed.parallel_state import RankInfo, TPGroup, local_world_ranks
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.layer import prepare_attention
from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from srt.models.decoder_stack import StageLayers
from srt.model_executor.pipeline_forward import micro_batch_count, split_forward_batch, stage_layers
from srt.server_args import ServerArgs


def test_rank_layout_dp2_pp2_tp2():
    infos = [RankInfo.for_world_rank(r, tp_size=2, dp_size=2, pp_size=2) for r in range(8)]
    assert [i.name for i in infos] == [
        "DP0_PP0_TP0", "DP0_PP0_TP1", "DP0_PP1_TP0", "DP0_PP1_TP1",
        "DP1_PP0_TP0", "DP1_PP0_TP1", "DP1_PP1_TP0", "DP1_PP1_TP1"]
    # The entry rank holds the logits: the last stage's TP rank 0 of each DP group.
    assert [i.world_rank for i in infos if i.is_entry_rank] == [2, 6]
    assert {i.entry_world_rank for i in infos[:4]} == {2} and {i.entry_world_rank for i in infos[4:]} == {6}
    assert [i.group_rank for i in infos] == [0, 1, 2, 3] * 2
    assert infos[3].log_prefix == "[DP0 PP1 TP1]" and infos[3].is_last_stage
    # At --pp-size 1 nothing changes: TP rank 0 is the entry rank, names as before.
    tp = RankInfo.for_world_rank(3, tp_size=2, dp_size=2)
    assert (tp.name, tp.is_entry_rank, tp.entry_world_rank) == ("DP1_TP1", False, 2)
    assert list(local_world_ranks(2, 2, 2, 1, pp_size=2)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="tp_size x pp_size x dp_size = 6 ranks"):
        RankInfo.for_world_rank(0, tp_size=1, dp_size=3, nnodes=4, pp_size=2)


def test_stage_layers_even_and_custom():
    assert [stage_layers(30, r, 4, None) for r in range(4)] == [
        StageLayers(0, 8, True, False), StageLayers(8, 16, False, False),
        StageLayers(16, 23, False, False), StageLayers(23, 30, False, True)]
    assert stage_layers(30, 1, 2, "18,12") == StageLayers(18, 30, first=False, last=True)
    with pytest.raises(ValueError, match="covers 29 layers; the model has 30"):
        stage_layers(30, 0, 2, "17,12")
    with pytest.raises(ValueError, match="at least one layer per stage"):
        stage_layers(2, 0, 3, None)


@pytest.mark.parametrize("kwargs, message", [
    ({"pp_size": 0}, "--pp-size must be at least 1"),
    ({"pp_size": 2, "pp_layer_partition": "30"}, "2 positive layer counts"),
    ({"pp_size": 2, "pp_layer_partition": "15,0"}, "2 positive layer counts"),
    ({"pp_size": 2, "pp_max_micro_batch_size": 0}, "--pp-max-micro-batch-size must be at least 1"),
    ({"pp_size": 2, "speculative_algorithm": "NGRAM"}, "not supported with --pp-size > 1"),
    ({"pp_size": 2, "tp_size": 3, "nnodes": 4, "dist_init_addr": "h:1"},
     r"--tp-size x --pp-size x --dp-size \(6 ranks\) must split evenly over --nnodes 4"),
])
def test_pipeline_flags_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def _extend_batch(lens: list[int], prefix: list[int], pool, req_pool) -> ForwardBatch:
    tokens = sum(lens)
    return ForwardBatch(ForwardMode.EXTEND, torch.arange(tokens), torch.arange(tokens), torch.arange(tokens),
                        torch.tensor([5, 7, 9][:len(lens)]), torch.tensor([p + n for p, n in zip(prefix, lens)]),
                        [p + n for p, n in zip(prefix, lens)], list(lens), list(prefix), req_pool, pool)


def test_split_cuts_inside_a_prompt_as_a_continuation():
    fb = _extend_batch([4, 6], [3, 0], None, None)
    parts = split_forward_batch(fb, 3)
    # 10 tokens in 3 parts: [0, 3), [3, 7), [7, 10); the second sequence is cut twice.
    assert [p.input_ids.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert [p.extend_seq_lens_cpu for p in parts] == [[3], [1, 3], [3]]
    assert [p.extend_prefix_lens_cpu for p in parts] == [[3], [6, 0], [3]]
    assert [p.seq_lens_cpu for p in parts] == [[6], [7, 3], [6]]
    assert [p.req_pool_indices.tolist() for p in parts] == [[5], [5, 7], [7]]
    assert split_forward_batch(fb, 1) == [fb]


def test_micro_batch_count():
    fb = _extend_batch([4, 6], [0, 0], None, None)
    assert micro_batch_count(fb, 2, None) == 2
    assert micro_batch_count(fb, 2, 1) == 2  # two sequences, at most one each
    assert micro_batch_count(dataclasses.replace(fb, seq_lens_cpu=[1] * 9), 2, 2) == 5
    assert micro_batch_count(_extend_batch([1], [0], None, None), 4, None) == 1  # one token
    assert micro_batch_count(dataclasses.replace(fb, mode=ForwardMode.MIXED), 4, None) == 1


class _Kv:
    """One stage's KV pool; every stage allocates the same slots (as the ranks do)."""

    def __init__(self, cfg: ModelConfig, layers: int):
        self.pool = MHATokenToKVPool(512, layers, cfg.num_kv_heads_per_rank(1), cfg.head_dim,
                                     torch.float32, "cpu")


def _stage_logits(stages, pools, fb: ForwardBatch, n_parts: int) -> torch.Tensor:
    """What PipelineForward computes, without the messages: each micro-batch through every
    stage in turn (any stage order per micro-batch is the same arithmetic)."""
    finals = []
    for k in range(n_parts):
        h = residual = None
        for stage, kv in zip(stages, pools):
            part = split_forward_batch(dataclasses.replace(fb, token_to_kv_pool=kv.pool), n_parts)[k]
            prepare_attention(TorchNativeAttnBackend(), part)
            if h is None:
                h = stage.model.embed_tokens(part.input_ids)
            h, residual = stage.model.run_layers(part, h, residual)
        finals.append(h + residual)
    return stages[-1].select_logits(fb, torch.cat(finals))


def test_two_stages_over_micro_batches_equal_the_whole_model(tiny_dir):
    cfg = ModelConfig.from_path(tiny_dir)
    whole = load_model(cfg, TPGroup(), torch.float32, "cpu")
    stages = [load_model(cfg, TPGroup(), torch.float32, "cpu", stage_layers(30, r, 2, "13,17")) for r in (0, 1)]
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is not None  # tied head
    assert sum(p.numel() for s in stages for p in s.parameters()) > sum(p.numel() for p in whole.parameters())
    req_pool = ReqToTokenPool(4, 64, "cpu")
    alloc = TokenToKVPoolAllocator(512, "cpu")
    rows = [req_pool.alloc(), req_pool.alloc()]
    whole_kv, stage_kv = _Kv(cfg, 30), [_Kv(cfg, 13), _Kv(cfg, 17)]
    prompts = [[1, 504, 3458, 282, 4649, 314, 28, 2], [1, 19556, 30, 11, 9]]
    lens = [0, 0]

    def batch(mode, new: list[list[int]]) -> ForwardBatch:
        ids, pos, locs = [], [], []
        for i, toks in enumerate(new):
            slots = alloc.alloc(len(toks))
            req_pool.req_to_token[rows[i], lens[i]:lens[i] + len(toks)] = slots
            ids += toks
            pos += range(lens[i], lens[i] + len(toks))
            locs.append(slots)
        prefix = list(lens)
        for i, toks in enumerate(new):
            lens[i] += len(toks)
        return ForwardBatch(mode, torch.tensor(ids), torch.tensor(pos), torch.cat(locs),
                            torch.tensor(rows), torch.tensor(lens), list(lens),
                            [len(t) for t in new], prefix, req_pool, whole_kv.pool)

    fb = batch(ForwardMode.EXTEND, prompts)
    want = whole(dataclasses.replace(fb))
    got = _stage_logits(stages, stage_kv, fb, 3)  # 13 tokens: cuts inside both prompts
    _assert_close(got, want)
    for _ in range(2):  # decode over the cached prompts, one row per micro-batch
        fb = batch(ForwardMode.DECODE, [[int(t)] for t in want.argmax(-1)])
        want = whole(dataclasses.replace(fb))
        _assert_close(_stage_logits(stages, stage_kv, fb, 2), want)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 rounding only (other GEMM row counts, a prefix attended from the pool): the
    parity tests' relative measure, and the same greedy tokens."""
    assert got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


class _NoBackend:
    """The manager is never asked to compile here."""


def test_no_collective_without_pending_grammars():
    # A group of two ranks without any process group: a collective would raise.
    group = TPGroup(rank=0, size=2, device_group=None, cpu_group=None)
    manager = GrammarManager(_NoBackend(), group, abort_request=lambda r, m: None,
                             polling=lambda: None, log_prefix="[test]")
    assert manager.get_ready_grammar_requests(idle=False) == ([], [])
    assert manager.get_ready_grammar_requests(idle=True) == ([], [])
