"""Token-level KV cache: a request-to-token table plus per-layer token-to-KV storage.

Slot 0 of the KV storage is a reserved dummy (padding writes land there), so the pool
holds ``size`` usable token slots numbered 1..size.
"""
from __future__ import annotations

import torch


class ReqToTokenPool:
    """Row ``i`` maps request slot ``i``'s token positions to KV slots."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)


class TokenToKVPoolAllocator:
    """Hands out KV slot indices. Deterministic, so every rank allocates identically."""

    def __init__(self, size: int, device: str):
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self._free = torch.cat((self._free, indices.to(self._free.device)))


class MHATokenToKVPool:
    """Per-layer K and V buffers ``[num_kv_heads, size + 1, head_dim]``.

    Head-major: gathering a batch's slots along dim 1 yields one contiguous
    ``[B, S, head_dim]`` block per KV head, which the decode matmuls read in place.
    """

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str):
        self.size = size
        shape = (num_kv_heads, size + 1, head_dim)
        # torch.empty: pages are only touched when written, so a large pool starts fast.
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: ``[T, num_kv_heads, head_dim]`` for the T slots in ``loc``."""
        # index_copy_: a plain scatter along the slot dim (no advanced-index assignment,
        # which builds index tensors per call); in place inside a compiled step too.
        self.k_buffer[layer_id].index_copy_(1, loc, k.transpose(0, 1))
        self.v_buffer[layer_id].index_copy_(1, loc, v.transpose(0, 1))
