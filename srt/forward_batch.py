"""What one model forward pass needs to know about the batch (built by the scheduler)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

if TYPE_CHECKING:
    from srt.layers.attention.base import AttentionBackend


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill: each sequence adds extend_seq_lens[i] tokens after a cached prefix
    DECODE = "decode"  # one new token per sequence


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
    attn_backend: Optional["AttentionBackend"] = None  # set by the model runner
    # Built once per step by the attention backend (DECODE): each row's KV slots, padded.
    decode_kv_slots: Optional[torch.Tensor] = None  # [B, S] int64
    decode_kv_valid: Optional[torch.Tensor] = None  # [B, S] bool

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
