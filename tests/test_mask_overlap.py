"""Where the grammar bitmask is filled (srt/scheduler/mask_overlap.py): beside the forward
on a thread of its own when a core is spare, else in line; the mask is the same either way."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.scheduler import mask_overlap
from srt.scheduler.req import Req

VOCAB = 49152


@pytest.mark.parametrize("cores,threads,device,overlaps", [
    (2, 2, "cpu", False),  # the forward's threads hold every core: in line
    (4, 2, "cpu", True),   # a spare core: beside the forward
    (2, 2, "cuda", True),  # the host waits on the device anyway
])
def test_fill_thread_only_where_a_core_is_spare(cores, threads, device, overlaps, monkeypatch):
    monkeypatch.setattr(mask_overlap.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(mask_overlap.torch, "get_num_threads", lambda: threads)
    executor = mask_overlap.mask_fill_executor(torch.device(device))
    assert (executor is not None) == overlaps
    if executor is not None:
        executor.shutdown()


def test_in_line_fill_equals_the_overlapped_one(smollm2_tokenizer):
    """A batch of an xgrammar row, an llguidance row and an unconstrained one, stepped
    through a document: the in-line fill (no executor) and the fill started ahead on a
    thread give the same bitmask at every step."""
    config = GrammarBackendConfig(VOCAB, (smollm2_tokenizer.eos_token_id,), JsonOptions())
    spec = json.dumps({"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]})
    backends = (XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, config),
                GuidanceBackend.from_tokenizer(smollm2_tokenizer, config))
    executor = ThreadPoolExecutor(1)

    def batch() -> SamplingBatchInfo:
        reqs = [Req(f"r{i}", (1,), SamplingParams(temperature=0), False, frozenset({0})) for i in range(3)]
        for r, b in zip(reqs, backends):
            r.grammar = b.init_value(("json_schema", spec)).copy()
        return SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", torch.Generator().manual_seed(0))

    in_line, ahead = batch(), batch()
    try:
        for tok in smollm2_tokenizer.encode('{"year": 1969}'):
            in_line.start_vocab_mask_fill(None)  # nothing starts: filled in update_regex_vocab_mask
            ahead.start_vocab_mask_fill(executor)
            assert ahead._mask_future is not None and in_line._mask_future is None
            in_line.update_regex_vocab_mask()
            ahead.update_regex_vocab_mask()
            assert torch.equal(in_line.vocab_mask, ahead.vocab_mask)
            assert torch.equal(in_line.vocab_mask[2], torch.full_like(in_line.vocab_mask[2], -1))
            for info in (in_line, ahead):
                for g in info.grammars[:2]:
                    g.accept_token(tok)
    finally:
        executor.shutdown()
