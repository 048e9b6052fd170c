"""Rotary position embedding (neox / Hugging Face Llama layout) with a cos/sin cache.

Frequencies and the attention scaling come from transformers' own
``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope, llama3, ...), so every scaling
type matches the reference implementation. Unlike Hugging Face, which recomputes
frequencies from the *current* batch length for ``dynamic`` and ``longrope``, a server
needs one position -> angle map that never changes under a cached KV entry:
- dynamic: frequencies for ``max(context_len, max_position_embeddings)`` (identical to
  Hugging Face for sequences within ``max_position_embeddings``);
- longrope: short factors below ``original_max_position_embeddings``, long factors
  from there on (what SGLang and vLLM do).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0


def _rope_params(config) -> dict:
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()  # folds legacy rope_theta / rope_scaling in
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
        config.rope_parameters = params
    return params


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    # Same float32 ops as transformers' rotary forward, so cached values are bit-identical.
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


class RotaryEmbedding(nn.Module):
    """Caches ``cos``/``sin`` of shape ``[max_positions, rotary_dim / 2]``.

    ``partial_rotary_factor`` < 1 (Qwen3.5, Qwen3-Next: 0.25) rotates only the first
    ``rotary_dim = head_dim * factor`` dims of each head and passes the rest through, as
    transformers' ``apply_rotary_pos_emb`` does. Qwen3.5's multimodal RoPE sections
    (``mrope_section``) collapse to this for text, whose three position ids are equal.
    """

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        params = _rope_params(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {factor} gives rotary_dim {self.rotary_dim} "
                             f"for head_dim {head_dim}: must be even and in (0, head_dim]")
        if factor != 1.0 and rope_type != "default":
            raise ValueError(f"partial_rotary_factor {factor} with rope_type {rope_type!r} is not "
                             "supported (only the default rope type)")
        self.rope_type = rope_type
        self.head_dim = head_dim
        positions = torch.arange(max_positions)
        if rope_type == "default":
            inv_freq, scale = _default_inv_freq(config, self.rotary_dim)
            cos, sin = _angles(positions, inv_freq, scale)
        elif rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: "
                             f"{['default', *sorted(ROPE_INIT_FUNCTIONS)]}")
        elif rope_type == "longrope":
            orig = params["original_max_position_embeddings"]
            short, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=None)
            long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=orig + 1)
            cos_s, sin_s = _angles(positions[:orig], short, scale)
            cos_l, sin_l = _angles(positions[orig:], long, scale)
            cos, sin = torch.cat((cos_s, cos_l)), torch.cat((sin_s, sin_l))
        else:
            seq_len = max_positions if rope_type == "dynamic" else None
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
            cos, sin = _angles(positions, inv_freq, scale)
        self.attention_scaling = float(scale)
        # Non-persistent buffers: follow .to(device) but are never loaded from checkpoints.
        self.register_buffer("cos_cache", cos.contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin.contiguous(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` by each token's position."""
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1).to(q.dtype)
        if self.rotary_dim == self.head_dim:
            return _apply(q, cos, sin), _apply(k, cos, sin)
        r = self.rotary_dim
        return (torch.cat((_apply(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((_apply(k[..., :r], cos, sin), k[..., r:]), dim=-1))


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), written on the halves.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
