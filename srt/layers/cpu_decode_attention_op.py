"""Where decode attention runs gramsync's own CPU op (cpu_decode_attention.cpp).

The torch path (torch_native.decode_attention_torch) gathers each row's keys and values out
of the pool into a fresh block, casts it and runs two batched matmuls; the op reads the pool
in place through the same slot table, once, and shares each key between the query heads of
its group. Used in eager steps and in the compiled graphs alike (torch.export and
AOTInductor packages call it like any op), on CPU, for float32 and bfloat16 pools, unless
``GRAMSYNC_CPU_DECODE_ATTENTION=0`` or the library cannot be built (no compiler): the torch
path then serves, and it stays the reference the op is tested against.
"""
from __future__ import annotations

import torch

from srt.layers.cpu_kernels import dynamo_constant, load_cpu_kernels


def decode_attention_op_wanted() -> bool:
    """The user's switch (``GRAMSYNC_CPU_DECODE_ATTENTION``, default on)."""
    from srt.environ import GRAMSYNC_CPU_DECODE_ATTENTION

    return GRAMSYNC_CPU_DECODE_ATTENTION.get()


@dynamo_constant  # Dynamo calls it, never traces the build
def decode_attention_op_available() -> bool:
    return decode_attention_op_wanted() and load_cpu_kernels()


def use_decode_attention_op(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_buf.dtype == q.dtype
            and decode_attention_op_available())
