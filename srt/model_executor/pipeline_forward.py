"""One scheduler step's forward through pipeline stages, in micro-batches (--pp-size).

Every rank built the same ForwardBatch (identical scheduling), so each stage cuts it into
the same micro-batches and knows every activation's shape without being told. Stage s
runs its layers over micro-batch k while stage s + 1 runs micro-batch k - 1: with m
micro-batches and p stages a step takes m + p - 1 micro-batch slots instead of m x p, so
the idle ("bubble") share is (p - 1) / (m + p - 1). A micro-batch is a token range of the
batch: decode rows, or prefill tokens (a cut inside a prompt makes its second part a
continuation whose prefix is the first part, already in this stage's KV pool: micro-batches
run in order on every stage).

The last stage gathers the final hidden states of all micro-batches and computes the logits
of the whole batch; the other stages return an empty ``[rows, 0]`` placeholder with the
same number of rows, so the scheduler's row bookkeeping is the same on every stage.
"""
from __future__ import annotations

from typing import Optional

import time
from dataclasses import dataclass

import torch

from distributed.pipeline import PipelineGroup, recv_activation, send_activation
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.layer import prepare_attention
from srt.layers.linear_attention.state_batch import build_state_batch
from srt.models.causal_lm import CausalLM, logit_row_index
from srt.models.decoder_stack import StageLayers


def stage_layers(num_layers: int, pp_rank: int, pp_size: int, partition: Optional[str]) -> StageLayers:
    """The layers stage ``pp_rank`` holds: --pp-layer-partition (layers per stage, e.g.
    "16,14"), else an even split with the remainder on the first stages."""
    if partition:
        counts = [int(c) for c in partition.split(",")]
        if sum(counts) != num_layers:
            raise ValueError(f"--pp-layer-partition {partition!r} covers {sum(counts)} layers; "
                             f"the model has {num_layers}")
    else:
        if num_layers < pp_size:
            raise ValueError(f"--pp-size {pp_size} needs at least one layer per stage; "
                             f"the model has {num_layers}")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (i < extra) for i in range(pp_size)]
    start = sum(counts[:pp_rank])
    return StageLayers(start, start + counts[pp_rank], first=pp_rank == 0, last=pp_rank == pp_size - 1)


def micro_batch_count(fb: ForwardBatch, pp_size: int, max_micro_batch_size: Optional[int]) -> int:
    """--pp-size micro-batches, more when --pp-max-micro-batch-size caps their sequences;
    never more than the batch's tokens. A MIXED batch is one micro-batch (its two parts
    attend apart)."""
    if fb.mode is ForwardMode.MIXED:
        return 1
    n = pp_size
    if max_micro_batch_size:
        n = max(n, -(-fb.batch_size // max_micro_batch_size))
    return max(1, min(n, fb.input_ids.shape[0]))


def split_forward_batch(fb: ForwardBatch, n: int) -> list[ForwardBatch]:
    """``n`` micro-batches of about equal token counts, in order."""
    total = fb.input_ids.shape[0]
    if n <= 1:
        return [fb]
    cuts = [round(k * total / n) for k in range(n + 1)]
    return [_token_range(fb, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _token_range(fb: ForwardBatch, t0: int, t1: int) -> ForwardBatch:
    """The batch's tokens ``[t0, t1)`` as a batch of their own: each sequence they touch
    keeps its part, with the tokens before it as prefix."""
    seqs, prefix, new, lens = [], [], [], []
    start = 0
    for i, (n_new, n_prefix) in enumerate(zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)):
        a, b = max(start, t0), min(start + n_new, t1)
        if a < b:
            seqs.append(i)
            prefix.append(n_prefix + a - start)
            new.append(b - a)
            lens.append(n_prefix + b - start)
        start += n_new
    idx = torch.tensor(seqs, dtype=torch.int64, device=fb.seq_lens.device)
    part = ForwardBatch(
        fb.mode, fb.input_ids[t0:t1], fb.positions[t0:t1], fb.out_cache_loc[t0:t1],
        fb.req_pool_indices[idx], torch.tensor(lens, dtype=fb.seq_lens.dtype, device=fb.seq_lens.device),
        lens, new, prefix, fb.req_to_token_pool, fb.token_to_kv_pool)
    if fb.state_marks is not None:  # hybrid checkpoints: offsets into each sequence's part
        part.state_marks = [tuple((off - (p - fb.extend_prefix_lens_cpu[i]), slot)
                                  for off, slot in fb.state_marks[i]
                                  if 0 < off - (p - fb.extend_prefix_lens_cpu[i]) <= n)
                            for i, p, n in zip(seqs, prefix, new)]
    return part


@dataclass
class StageTimes:
    """Where this stage's forward time went, summed over steps (benchmark/bench_pipeline.py
    prints them): running its layers, waiting for the previous stage's activations (the
    bubble, and any imbalance between stages), and waiting for its sends to complete."""

    steps: int = 0
    micro_batches: int = 0
    compute_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0


class PipelineForward:
    """This stage's part of every forward (``ModelRunner.forward`` at --pp-size > 1)."""

    def __init__(self, model: CausalLM, pp: PipelineGroup, attn_backend, dtype: torch.dtype,
                 device, max_micro_batch_size: Optional[int], state_pool=None):
        self.model, self.pp, self.attn_backend = model, pp, attn_backend
        self.state_pool = state_pool  # hybrid models: this stage's GDN layers' states
        self.dtype, self.device = dtype, device
        self.hidden_size = model.config.hidden_size
        self.max_micro_batch_size = max_micro_batch_size
        self.times = StageTimes()

    @torch.inference_mode()
    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        pp, decoder = self.pp, self.model.model
        parts = split_forward_batch(fb, micro_batch_count(fb, pp.size, self.max_micro_batch_size))
        for i, part in enumerate(parts):
            prepare_attention(self.attn_backend, part)
            if self.state_pool is not None:  # micro-batches run in order: each continues the slot
                part.linear_state = build_state_batch(part, self.state_pool, new_step=i == 0)
        finals, sends = [], []
        times, clock = self.times, time.perf_counter
        for part in parts:
            t0 = clock()
            if pp.is_first:
                h, residual = decoder.embed_tokens(part.input_ids), None
            else:
                shape = (2, part.input_ids.shape[0], self.hidden_size)
                h, residual = recv_activation(shape, self.dtype, self.device, pp).unbind(0)
            t1 = clock()
            h, residual = decoder.run_layers(part, h, residual)
            times.recv_wait_s += t1 - t0
            times.compute_s += clock() - t1
            if pp.is_last:
                finals.append(h + residual)
            else:  # the next stage starts on it while this one runs the next micro-batch
                out = torch.stack([h, residual])
                sends.append((send_activation(out, pp), out))
        t0 = clock()
        for work, _ in sends:
            work.wait()
        times.send_wait_s += clock() - t0
        times.steps += 1
        times.micro_batches += len(parts)
        if not pp.is_last:
            rows = logit_row_index(fb, self.device)
            return torch.empty((fb.input_ids.shape[0] if rows is None else rows.numel(), 0),
                               device=self.device)
        t0 = clock()
        logits = self.model.select_logits(fb, finals[0] if len(finals) == 1 else torch.cat(finals))
        times.compute_s += clock() - t0  # the final norm and the LM head
        return logits
