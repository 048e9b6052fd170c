"""A GGUF's own 4-bit codes (Q4_0 / Q4_1), kept beside its dequantized conversion.

The GGUF conversion (model_loader.py) dequantizes every tensor for the dense paths; this
module also writes ``gguf_int4.safetensors`` into the converted folder: for each Q4_0 / Q4_1
matrix, under its Hugging Face name, the file's codes (``<name>.codes``, uint8 0..15,
``[N, K]``) and its per-32-input scale and minimum (``<name>.scale``, ``<name>.min``, fp32
``[N, K / 32]``, the file's fp16 values), so value = scale * code + min:

- Q4_1 (value = d * q + m): scale = d, min = m;
- Q4_0 (value = d * (q - 8)): scale = d, min = -8 d.

Rows are in the checkpoint's order: llama.cpp permutes the rows of q and k for its rotary
layout, and transformers un-permutes them on load. Rather than knowing each family's
permutation, each matrix is checked against the dense tensor transformers produced: its
codes, decoded with the file's d and m, must give that tensor (as in the file, or
un-permuted as transformers does for llama's q and k); a matrix that matches neither is left
out, so the loader serves the model dense (gguf_int4.py).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

GGUF_INT4_FILE = "gguf_int4.safetensors"
GROUP = 32


def _decode_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, K] uint8, d [N, K/32] fp32, m [N, K/32] fp32) of a Q4_0 / Q4_1 matrix."""
    size = 20 if kind == "Q4_1" else 18
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    else:
        m, qs = -8 * d, blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # low nibbles: inputs 0-15 of the block
    return codes.reshape(n, -1), d, m


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse of llama.cpp's q/k row permutation (rows only)."""
    dim = x.shape[0] // heads // 2
    return x.reshape(heads, dim, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _matches(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dense: torch.Tensor) -> bool:
    values = (d.repeat_interleave(GROUP, 1) * codes.float() + m.repeat_interleave(GROUP, 1))
    tol = 1e-6 * float(dense.abs().max()) + 1e-12
    return values.shape == dense.shape and bool((values - dense.float()).abs().max() <= tol)


def _in_checkpoint_order(codes, d, m, dense, gguf_name: str, heads: dict[str, int]):
    """The three in the dense tensor's row order, or None where no known order matches."""
    orders = [None] + [heads[k] for k in ("attn_q", "attn_k") if f".{k}." in gguf_name]
    for order in orders:
        c, dd, mm = (codes, d, m) if order is None else (_unpermute_rows(t, order) for t in (codes, d, m))
        if _matches(c, dd, mm, dense):
            return c, dd, mm
    return None


def write_gguf_int4_codes(gguf_path: str, dense: dict[str, torch.Tensor], config: dict,
                          out_dir: str) -> Optional[str]:
    """Write ``GGUF_INT4_FILE`` for ``gguf_path``'s Q4_0 / Q4_1 matrices into ``out_dir``;
    ``dense``: the converted state dict (HF names). Returns the file, or None where the
    GGUF holds no such matrix. Metadata: every weight's GGUF type by HF name, and the Q4
    matrices left out (rows in no known order), for the loader's log."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((a for a, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        return None
    names = gguf.get_tensor_name_map(arch, int(config.get("num_hidden_layers", 0)))
    to_hf = {names.get_name(hf, try_suffixes=(".weight", ".bias")): hf for hf in dense}
    heads = {"attn_q": int(config.get("num_attention_heads", 1)),
             "attn_k": int(config.get("num_key_value_heads") or config.get("num_attention_heads", 1))}
    out, types, left_out = {}, {}, []
    for t in reader.tensors:
        hf = to_hf.get(t.name)
        if hf is None:
            continue
        kind = t.tensor_type.name
        types[hf] = kind
        if kind not in ("Q4_0", "Q4_1") or len(t.shape) != 2:
            continue
        codes, d, m = (torch.from_numpy(np.ascontiguousarray(a)) for a in _decode_blocks(t.data, kind))
        found = _in_checkpoint_order(codes, d, m, dense[hf], t.name, heads)
        if found is None:
            left_out.append(hf)
            continue
        codes, d, m = found
        out[f"{hf}.codes"] = codes.contiguous()
        out[f"{hf}.scale"] = d.contiguous()
        out[f"{hf}.min"] = m.contiguous()
    if not out and not left_out:
        return None
    if left_out:
        logger.warning("GGUF %s: %d Q4 matrices match no known row order and stay dense (%s ...)",
                       gguf_path, len(left_out), left_out[0])
    path = os.path.join(out_dir, GGUF_INT4_FILE)
    save_file(out, path, metadata={"format": "pt", "gguf_types": json.dumps(types),
                                   "left_out": json.dumps(left_out)})
    return path
