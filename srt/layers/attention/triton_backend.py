"""CUDA attention through our Triton kernels (``triton_ops``): decode and extend both read
the paged KV pool in place through ``req_to_token``; extend is varlen (no padding, no
per-sequence Python loop). Unverified on GPU hardware until a GPU run says otherwise
(docs/speed-history.md); the kernels are checked against a torch reference under TRITON_INTERPRET=1."""
from __future__ import annotations

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.base import AttentionBackend


class TritonAttnBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        from srt.layers.attention import triton_ops  # imports triton: CUDA only

        self._ops = triton_ops
        self._prefix_lens = self._extend_lens = None
        self._max_extend_len = 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.EXTEND:  # once per step, not per layer
            dev = fb.seq_lens.device
            self._prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=dev)
            self._extend_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=dev)
            self._max_extend_len = max(fb.extend_seq_lens_cpu)  # host value: no sync per layer

    def forward_decode(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        return self._ops.decode_attention(
            q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, layer.scaling)

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        return self._ops.extend_attention(
            q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, self._prefix_lens,
            self._extend_lens, layer.scaling, max_extend_len=self._max_extend_len)
