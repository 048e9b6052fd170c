"""The embedded model served with int4 weights on CPU (``--torchao-config int4wo-32``):
torch's CPU int4 kernel on the decoder's linear layers, whose GGUF weights are Q4_1 (groups
of 32), and an int8 LM head (Q8_0 in the GGUF; our int8 GEMV with AVX512-BF16, else torch's
kernel) in steps of up to 16 rows, so the perplexity on the
repo's text stays within 3% of the dense model's (the issue's bound), and the scheduler
decodes with it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

pytest.importorskip("torchao")


def _scheduler(model_dir, tokenizer, **kwargs):
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.model_executor.model_config import ModelConfig
    from srt.scheduler.scheduler import Scheduler
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, random_seed=0, dtype="float32", max_running_requests=4,
                      max_total_tokens=2048, disable_torch_compile=True, **kwargs)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(model_dir, None), tokenizer)


def test_int4_perplexity_within_3_percent_and_it_decodes(smollm2_dir, smollm2_tokenizer):
    from bench_offline import chat_prompts
    from bench_quant import TEXT, greedy, perplexity
    from srt.layers.cpu_int4_linear import Int4Weight
    from srt.layers.cpu_int8_linear import Int8Weight
    from srt.layers.cpu_qgemv import PanelInt8, SmallBatchQuantized
    from srt.tokenizer_utils import apply_chat_template

    torch.set_grad_enabled(False)
    ids = smollm2_tokenizer(TEXT.read_text())["input_ids"][:512]
    prompts = [apply_chat_template(smollm2_tokenizer, m) for m in chat_prompts(2)]
    dense = _scheduler(smollm2_dir, smollm2_tokenizer)
    want = perplexity(dense, ids)
    del dense
    q = _scheduler(smollm2_dir, smollm2_tokenizer, torchao_config="int4wo-32")
    layer = q.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.packed_weight, Int4Weight)
    head = q.runner.model.lm_head.packed_weight  # int8 up to 16 rows: ours (AVX512-BF16) or torch's
    assert isinstance(head, SmallBatchQuantized) and isinstance(head.quantized, (Int8Weight, PanelInt8))
    assert not q.runner.model.model.embed_tokens.weight.is_meta  # the tied embedding stays dense
    got = perplexity(q, ids)
    print(f"perplexity dense {want:.4f} int4 {got:.4f} ({got / want - 1:+.2%})")
    assert got != want and abs(got / want - 1) < 0.03, (got, want)
    out = greedy(q, prompts, 16, "int4")
    assert [len(o) for o in out] == [16, 16]
