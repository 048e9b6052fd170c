"""What one model forward pass needs to know about the batch (built by the scheduler)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill: each sequence adds extend_seq_lens[i] tokens after a cached prefix
    DECODE = "decode"  # one new token per sequence
    # --enable-mixed-chunk: a DECODE part's rows first, then an EXTEND part's tokens, in one
    # forward (``mixed_batch``); attention runs each part as its own mode.
    MIXED = "mixed"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot for each new token
    req_pool_indices: torch.Tensor  # [B] int64, row in req_to_token
    seq_lens: torch.Tensor  # [B] int64, total length after this pass
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]  # EXTEND: new tokens per sequence (DECODE: all 1)
    extend_prefix_lens_cpu: list[int]  # EXTEND: tokens already in the KV cache (DECODE: seq_len-1)
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    return_all_logits: bool = False  # True: logits for every new token (tests); else last per seq
    # EXTEND: the rows of input_ids whose logits to return (prompt logprobs need more than
    # the last per sequence); None: the last per sequence.
    logit_rows: Optional[list[int]] = None
    # set by the model runner: a layers/attention/base.py AttentionBackend (not imported:
    # the backends depend on this module, not it on them)
    attn_backend: Optional[Any] = None
    # Built once per step by the attention backend (DECODE): each row's KV slots, padded.
    decode_kv_slots: Optional[torch.Tensor] = None  # [B, S] int64
    decode_kv_valid: Optional[torch.Tensor] = None  # [B, S] bool
    # torch_native decode attention's kernel for this batch (None: the eager one); a MIXED
    # step's decode part gets the compiled prefill's (its decode graph is not in use).
    decode_attention: Optional[Callable] = None
    # Hybrid models: the step's linear-attention state view (layers/linear_attention/state_batch.py),
    # built by the model runner beside the attention metadata.
    linear_state: Optional[Any] = None
    # DECODE with speculative drafts: keep each row's linear state, for the rollback of
    # rejected drafts (mem_cache/linear_state_pool.py).
    keep_row_states: bool = False
    # EXTEND, hybrid models with the radix cache: per sequence, (offset in its new tokens,
    # checkpoint slot) where the prefill keeps its state (mem_cache/state_checkpoints.py).
    state_marks: Optional[list[tuple[tuple[int, int], ...]]] = None
    # MIXED: the two parts this batch concatenates (decode rows first).
    decode_part: Optional["ForwardBatch"] = None
    extend_part: Optional["ForwardBatch"] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


def mixed_batch(decode: ForwardBatch, extend: ForwardBatch) -> ForwardBatch:
    """One forward over a decode batch's rows and then an extend batch's tokens (SGLang's
    mixed chunk). Token-wise tensors are concatenated; per-sequence metadata stays on the
    parts, which attention reads (``decode_part`` / ``extend_part``). Logits: every decode
    row, then the extend part's rows (its ``logit_rows``, or its last token per sequence)."""
    cat = torch.cat
    return ForwardBatch(
        mode=ForwardMode.MIXED,
        input_ids=cat([decode.input_ids, extend.input_ids]),
        positions=cat([decode.positions, extend.positions]),
        out_cache_loc=cat([decode.out_cache_loc, extend.out_cache_loc]),
        req_pool_indices=cat([decode.req_pool_indices, extend.req_pool_indices]),
        seq_lens=cat([decode.seq_lens, extend.seq_lens]),
        seq_lens_cpu=decode.seq_lens_cpu + extend.seq_lens_cpu,
        extend_seq_lens_cpu=decode.extend_seq_lens_cpu + extend.extend_seq_lens_cpu,
        extend_prefix_lens_cpu=decode.extend_prefix_lens_cpu + extend.extend_prefix_lens_cpu,
        req_to_token_pool=extend.req_to_token_pool,
        token_to_kv_pool=extend.token_to_kv_pool,
        decode_part=decode,
        extend_part=extend,
    )
