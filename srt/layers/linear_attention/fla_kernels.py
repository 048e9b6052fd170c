"""FLA's (flash-linear-attention, ``fla-core`` on PyPI) Triton kernels for the gated delta rule
on CUDA, behind the torch functions' interface: what SGLang and vLLM run for Qwen3.5 /
Qwen3-Next. Same shapes and state layout as gated_delta_rule.py ([B, T, H, D] inputs, q/k with
fewer heads than v allowed, fp32 state [B, Hv, Dk, Dv]), so the layer switches by device.

Used when the tensors are on CUDA, ``fla`` imports and GRAMSYNC_FLA_KERNELS is on; the torch
path stays the reference (tests/test_fla_kernels.py compares them, in ``make gpu-check``).
"""
from __future__ import annotations

import functools

import torch

from srt import environ


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or no GPU build of its dependencies
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and environ.GRAMSYNC_FLA_KERNELS.get() and _kernels() is not None


def fla_gated_delta_rule(q, k, v, g, beta, state, recurrent: bool):
    """``(out [B, T, Hv, Dv], final state fp32)``; q/k L2-normalised inside the kernel."""
    chunk, fused_recurrent = _kernels()
    fn = fused_recurrent if recurrent else chunk
    out, final = fn(q, k, v, g=g, beta=beta, initial_state=None if state is None else state.float(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, final.float()
