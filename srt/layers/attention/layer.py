"""The attention layer: writes each new token's K/V into the pool, then asks the batch's
backend to attend (``fb.attn_backend``; plain torch when a caller built ``fb`` by hand)."""
from __future__ import annotations

import torch
from torch import nn

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, KVH*D]`` -> ``[T, H*D]``."""
        T, D = q.shape[0], self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        fb.token_to_kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        backend = fb.attn_backend
        if backend is None:  # a hand-built batch (tests): the CPU reference path
            from srt.layers.attention.torch_native import TorchNativeAttnBackend

            backend = TorchNativeAttnBackend()
            prepare_attention(backend, fb)
        if fb.mode == ForwardMode.DECODE:
            out = backend.forward_decode(q, self, fb)
        elif fb.mode == ForwardMode.MIXED:  # every row's K/V is in the pool: parts attend apart
            d = fb.decode_part.batch_size
            out = torch.cat([backend.forward_decode(q[:d], self, fb.decode_part),
                             backend.forward_extend(q[d:], k[d:], v[d:], self, fb.extend_part)])
        else:
            out = backend.forward_extend(q, k, v, self, fb)
        return out.reshape(T, self.num_heads * D)


def prepare_attention(backend, fb: ForwardBatch) -> None:
    """Give the batch (and a MIXED batch's parts) its backend and this step's metadata, once
    per step, outside the layers."""
    for part in (fb, fb.decode_part, fb.extend_part):
        if part is not None:
            part.attn_backend = backend
            backend.init_forward_metadata(part)
