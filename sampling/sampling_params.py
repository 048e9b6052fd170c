"""Per-request sampling parameters, validated with messages the HTTP layer returns as 400."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

_GREEDY_EPS = 1e-6
_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """SGLang-shaped sampling parameters. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys and bad types raise ValueError."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        if d.get("max_new_tokens", 0) is None:
            d.pop("max_new_tokens")
        stop = d.get("stop")
        if stop is None:
            d.pop("stop", None)
        elif isinstance(stop, str):
            d["stop"] = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            d["stop"] = tuple(stop)
        else:
            raise ValueError("stop must be a string or a list of strings")
        ids = d.get("stop_token_ids")
        if ids is None:
            d.pop("stop_token_ids", None)
        elif isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids):
            d["stop_token_ids"] = tuple(ids)
        else:
            raise ValueError("stop_token_ids must be a list of integers")
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            if name in d and not _is_int(d[name]):
                raise ValueError(f"{name} must be an integer, got {d[name]!r}")
        if d.get("seed") is not None and not _is_int(d["seed"]):
            raise ValueError(f"seed must be an integer, got {d['seed']!r}")
        for name in ("temperature", "top_p", "min_p"):
            if name in d and (isinstance(d[name], bool) or not isinstance(d[name], (int, float))):
                raise ValueError(f"{name} must be a number, got {d[name]!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if name in d and not isinstance(d[name], bool):
                raise ValueError(f"{name} must be a boolean, got {d[name]!r}")
        params = cls(**d)
        params.verify()
        return params

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the field, the allowed range and the offending value."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be at least 0, got {self.min_new_tokens}.")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}."
            )
        if self.seed is not None and not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63-1], got {self.seed}.")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}."
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
