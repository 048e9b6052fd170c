"""Tensor parallelism (TP=2) for the hybrid Gated DeltaNet families, in real gloo processes:
each rank holds its key-head groups of every GDN layer (in_proj_qkv and conv1d narrowed per
q / k / v part, Qwen3-Next's fused interleaved projections de-interleaved first) and its
query heads of the gated attention; logits on both ranks equal TP=1's.

A prompt longer than the 64-token chunk of the chunked delta rule, a second prefill chunk on
the carried state, then greedy decode steps. In float64 TP=2 equals TP=1 to rounding (the
sharding is exact). In float32 only to fp32's own noise on these random weights: the chunked
solve amplifies a reordered sum's last bit, and TP=1 in fp32 is itself up to ~2e-4 from its
float64 result, so that check is relative, at test_hybrid_models' 1e-4. TP=1 itself is checked
against transformers there.
"""
from __future__ import annotations

import pytest
import torch

from distributed.parallel_state import TPGroup
from srt.model_executor.forward_batch import ForwardMode
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from test_distributed import run_world
from test_hybrid_models import save_hybrid

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
DTYPES = (torch.float64, torch.float32)
PROMPTS = [[(7 * i + 3) % 300 for i in range(70)], [1], [42, 43, 44, 45, 46, 47, 48, 49, 50]]
TAIL = 3  # tokens of each multi-token prompt prefilled as a second chunk, on the carried state


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_tp")
    return {kind: save_hybrid(kind, root / kind) for kind in KINDS}


def _run(model_dir: str, tp: TPGroup, dtype: torch.dtype) -> list:
    """Logits of two prefill chunks (all positions) and two greedy decode steps, then what
    this rank was built with: (GDN state shapes, attention heads, KV heads)."""
    from test_model_parity import _Runner

    cfg = ModelConfig.from_path(model_dir)
    model = load_model(cfg, tp, dtype, "cpu")
    run = _Runner(model, cfg, len(PROMPTS), max_ctx=128, dtype=dtype, tp_size=tp.size)
    seqs = list(range(len(PROMPTS)))
    cut = [len(p) - TAIL if len(p) > TAIL else len(p) for p in PROMPTS]
    out = [run.step(ForwardMode.EXTEND, [p[:c] for p, c in zip(PROMPTS, cut)], seqs)]
    tail = [i for i, p in enumerate(PROMPTS) if len(p) > cut[i]]
    out.append(run.step(ForwardMode.EXTEND, [PROMPTS[i][cut[i]:] for i in tail], tail))
    ends = {i: row for i, row in zip(tail, torch.tensor([TAIL] * len(tail)).cumsum(0) - 1)}
    first = torch.tensor(cut).cumsum(0) - 1
    last = torch.stack([out[1][ends[i]] if i in ends else out[0][first[i]] for i in seqs])
    for _ in range(2):
        last = run.step(ForwardMode.DECODE, [[t] for t in last.argmax(-1).tolist()], seqs)
        out.append(last)
    attn = next(layer.self_attn for layer in model.model.layers if layer.state_index is None)
    built = (model.linear_layers()[0].state_shapes(), attn.num_heads, attn.num_kv_heads)
    return [o.numpy() for o in out] + [built]


def _no_grouped_mm(x, w13, w2) -> bool:
    return False  # torch._grouped_mm has no float64 kernel: the per-expert loop (same math)


def _run_all(dirs: list[str], tp: TPGroup) -> list:
    return [[_run(d, tp, dtype) for dtype in DTYPES] for d in dirs]


def _tp_worker(info, tp: TPGroup, world, dirs: list[str]) -> list:
    from srt.layers.moe import experts_torch

    experts_torch._grouped_mm_runs = _no_grouped_mm  # a spawned process: nothing to restore
    return _run_all(dirs, tp)


@pytest.mark.timeout(240)
def test_tp2_matches_tp1(hybrid_dirs, monkeypatch):
    from srt.layers.moe import experts_torch

    monkeypatch.setattr(experts_torch, "_grouped_mm_runs", _no_grouped_mm)
    dirs = [hybrid_dirs[k] for k in KINDS]
    results = run_world(_tp_worker, 2, 1, dirs, deadline_s=210)
    refs = _run_all(dirs, TPGroup())
    for i, kind in enumerate(KINDS):
        for j, dtype in enumerate(DTYPES):
            ref = refs[i][j]
            (conv, rec), heads, kv = ref[-1]
            assert (conv, rec, heads, kv) == ((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16), 4, 2)
            for rank in (0, 1):
                got = results[rank][i][j]
                # Half of every head count: the state pool each rank allocates is its own share.
                assert got[-1] == (((conv[0] // 2, 3), (2, 16, 16)), 2, 1), f"{kind} rank {rank}: {got[-1]}"
                for step, (g, r) in enumerate(zip(got[:-1], ref[:-1])):
                    assert g.shape == r.shape, f"{kind} step {step}: shape {g.shape} vs {r.shape}"
                    g, r = torch.from_numpy(g).double(), torch.from_numpy(r).double()
                    err = ((g - r).abs().max() / (1 if dtype == torch.float64 else r.abs().max())).item()
                    bound = 1e-10 if dtype == torch.float64 else 1e-4
                    assert err < bound, f"{kind} {dtype} rank {rank} step {step}: error {err:.2e}"


@pytest.mark.parametrize("tp,overrides,what", [
    (2, {"linear_num_key_heads": 3, "linear_num_value_heads": 6}, "linear_num_key_heads=3"),
    (4, {}, "linear_num_key_heads=2"),
    # 2H = 6 query "heads" would split 3 / 3, parting head 1's query from its gate: refused.
    (2, {"num_attention_heads": 3, "num_key_value_heads": 1}, "num_attention_heads=3"),
    (2, {"num_attention_heads": 6, "num_key_value_heads": 3}, "num_key_value_heads=3"),
])
def test_indivisible_heads_are_refused_not_padded(hybrid_dirs, tp, overrides, what):
    # Refused while the model is built, before any collective: a group without processes will do.
    cfg = ModelConfig.from_path(hybrid_dirs["qwen3_5"], overrides=overrides)
    with pytest.raises(ValueError, match=f"--tp-size {tp} does not split the heads .*{what}"):
        load_model(cfg, TPGroup(rank=0, size=tp), torch.float32, "cpu")


def test_gated_deltanet_refuses_a_tp_size_that_splits_a_key_head_group(hybrid_dirs):
    from srt.layers.linear_attention.gated_deltanet import GatedDeltaNet

    hf = ModelConfig.from_path(hybrid_dirs["qwen3_5"]).hf_config
    with pytest.raises(ValueError, match="--tp-size 4 does not divide linear_num_key_heads=2"):
        GatedDeltaNet(hf, TPGroup(rank=0, size=4))
