"""Per-row random numbers that depend only on (seed, output position) for seeded requests.

Every sampling step draws one uniform u in (0, 1) per row and picks the token whose
cumulative probability first exceeds u (inverse-CDF sampling). For a seeded request u is a
SplitMix64 hash of (seed, position): no generator state is shared with other rows, so the
same request gets the same tokens alone, in any batch, in any run and on every rank.
Unseeded rows draw from the scheduler's generator, which every rank seeds identically and
advances in the same order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """SplitMix64 finalizer: a bijective 64-bit mix with good avalanche behaviour."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in the open interval (0, 1) determined by (seed, position) alone."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return ((h >> 12) + 0.5) * 2.0**-52  # 52 bits + 1/2: exact, in [2^-53, 1 - 2^-53]


def row_uniforms(seeds: Sequence[Optional[int]], positions: Sequence[int],
                 generator: torch.Generator, device) -> torch.Tensor:
    """float64 [B] uniforms in (0, 1): hashed for seeded rows, drawn for the others."""
    out = [seeded_uniform(s, p) if s is not None else 0.0 for s, p in zip(seeds, positions)]
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        drawn = torch.rand(len(unseeded), generator=generator, dtype=torch.float64,
                           device=generator.device).clamp_(min=2.0**-60).tolist()
        for i, u in zip(unseeded, drawn):
            out[i] = u
    return torch.tensor(out, dtype=torch.float64, device=device)
