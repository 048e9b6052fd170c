"""CUDA graphs for decode: the bucket plan and flags everywhere; capture and replay against
the eager step on a GPU (skipped without CUDA: graphs cannot be emulated on CPU)."""
from __future__ import annotations

import pytest
import torch

from srt.model_executor.cuda_graph_runner import capture_batch_sizes
from srt.server_args import ServerArgs


def test_bucket_plan_is_sglangs_and_always_holds_max_bs():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 37]


def test_cuda_graph_max_bs_must_be_positive():
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        ServerArgs(model_path="x", cuda_graph_max_bs=0)


def test_cpu_runner_captures_nothing(smollm2_dir, smollm2_tokenizer):
    from tests.test_compiled_decode import _scheduler

    sched = _scheduler(smollm2_dir, smollm2_tokenizer, disable_torch_compile=True)
    assert sched.runner.cuda_graph_runner is None  # CPU: no graphs, no capture cost


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_matches_eager_greedy(smollm2_dir, smollm2_tokenizer):
    """Batches of 3 and 5 (padded to buckets 4 and 8) decode the same tokens with graphs
    as without them."""
    from tests.test_compiled_decode import _greedy, _scheduler  # puts benchmark/ on sys.path
    from bench_offline import chat_prompts

    graphs = _scheduler(smollm2_dir, smollm2_tokenizer, device="cuda")
    eager = _scheduler(smollm2_dir, smollm2_tokenizer, device="cuda", disable_cuda_graph=True)
    runner = graphs.runner.cuda_graph_runner
    assert runner is not None and runner.batch_sizes == [1, 2, 4, 8]
    assert eager.runner.cuda_graph_runner is None
    for batch in (3, 5):
        got = _greedy(graphs, smollm2_tokenizer, chat_prompts(batch), f"g{batch}")
        want = _greedy(eager, smollm2_tokenizer, chat_prompts(batch), f"e{batch}")
        assert list(got.values()) == list(want.values())
