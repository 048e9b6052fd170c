"""Attention: one layer, backends behind one interface, chosen by ``--attention-backend``.

- ``torch_native``: plain torch (SDPA, batched matmuls, Inductor-fused decode when the
  step is compiled); the CPU backend, and a reference on any device.
- ``triton``: Triton decode/extend kernels reading the paged pool in place (CUDA).
"""
from __future__ import annotations

from srt.layers.attention.base import AttentionBackend
from srt.layers.attention.layer import Attention

ATTENTION_BACKENDS = ("auto", "torch_native", "triton")


def create_attention_backend(name: str, device: str) -> AttentionBackend:
    """``auto``: triton on CUDA, torch_native elsewhere."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch_native"
    if name == "torch_native":
        from srt.layers.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend()
    if name == "triton":
        if not device.startswith("cuda"):
            raise ValueError("--attention-backend triton needs a CUDA device (on CPU use torch_native)")
        from srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    raise ValueError(f"Unknown --attention-backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}")


__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionBackend", "create_attention_backend"]
