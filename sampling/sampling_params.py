"""Per-request sampling parameters, validated with messages the HTTP layer returns as 400."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from constrained.grammar_config import FREE_GRAMMAR_KEY
from constrained.json_input import load_json_text, lone_surrogate_path
from constrained.schema_coverage import with_strict
from constrained.schema_refs import check_no_external_refs

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; ours for every API

_GREEDY_EPS = 1e-6
_MAX_SEED = 2**63 - 1
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "choice", "structural_tag")
_MAX_CHOICES = 1024
MAX_N = 128  # samples per request (OpenAI's limit)


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Sorted (token id, bias) pairs: a tuple keeps the dataclass immutable and picklable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: Optional[int] = None
    skip_special_tokens: bool = True
    n: int = 1  # independent samples of the prompt (the frontend splits them)
    # Constraints (at most one); the grammar backends give them meaning.
    json_schema: Optional[str] = None
    # OpenAI's ``strict``: served only by a grammar enforcing every keyword, else a 400
    # (the spec then carries schema_coverage.STRICT_KEY, so it is part of the cache key).
    json_schema_strict: bool = False
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    structural_tag: Optional[str] = None
    # CustomLogitProcessor.to_str() ({"callable": "module:Class"}; needs
    # --enable-custom-logit-processor) and the JSON parameters it receives for this request.
    custom_logit_processor: Optional[str] = None
    custom_params: Optional[dict] = None
    # Thinking models (--reasoning-parser): most tokens the request may think before the
    # think end is forced (docs/reasoning.md); enforced by its grammar.
    thinking_budget: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys and bad types raise ValueError."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
        # JSON null means "the default" (prepare_request has already read a null
        # max_new_tokens as "fill the context").
        if d.get("max_new_tokens", 0) is None:
            d.pop("max_new_tokens")
        _normalize_stops(d)
        d["logit_bias"] = _parse_logit_bias(d.get("logit_bias"))
        _normalize_constraints(d)
        _check_value_types(d)
        params = cls(**d)
        params.verify()
        return params

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the field, the allowed range and the offending value."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            if abs(getattr(self, name)) >= 2**63:
                raise ValueError(f"{name} must fit in 64 bits, got {getattr(self, name)}.")
        if any(abs(t) >= 2**63 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must fit in 64 bits.")
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
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        for tok, bias in self.logit_bias:
            if not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}.")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}.")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"Only one constraint kind per request is allowed, got {' and '.join(given)}.")
        if self.thinking_budget is not None and (not _is_int(self.thinking_budget) or self.thinking_budget < 0
                                                 or self.thinking_budget >= 2**63):
            raise ValueError("thinking_budget must be a non-negative integer (tokens of thinking before "
                             f"the think end is forced; 0 forces it at once), got {self.thinking_budget!r}.")
        if self.custom_params is not None and self.custom_logit_processor is None:
            raise ValueError("custom_params needs a custom_logit_processor.")
        if vocab_size is not None:
            bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}.")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}."
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def constraint(self) -> Optional[tuple[str, str]]:
        """(kind, normalized spec) of the request's grammar constraint, if any: the key of
        the grammar cache (choice lists are JSON-encoded)."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, json.dumps(list(value), ensure_ascii=False) if name == "choice" else value
        return None

    @property
    def grammar_key(self) -> Optional[tuple[str, str]]:
        """The grammar the scheduler attaches: the constraint's, or for a thinking_budget
        alone the pass-through one (constrained/free_grammar.py)."""
        key = self.constraint
        if key is None and self.thinking_budget is not None:
            return FREE_GRAMMAR_KEY
        return key

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _normalize_stops(d: dict) -> None:
    """stop and stop_token_ids as tuples (a lone stop string is a one-item list); nulls
    dropped so the defaults apply."""
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


def _normalize_constraints(d: dict) -> None:
    """JSON specs as compact text (equal specs share one grammar cache entry), with
    ``strict`` folded into the schema; choice lists checked."""
    if d.get("json_schema_strict", False) is None:
        d.pop("json_schema_strict")
    elif not isinstance(d.get("json_schema_strict", False), bool):
        raise ValueError(f"json_schema_strict must be a boolean, got {d['json_schema_strict']!r}")
    if d.get("json_schema_strict") and d.get("json_schema") is None:
        raise ValueError("json_schema_strict needs a json_schema.")
    for name in ("json_schema", "structural_tag"):
        if d.get(name) is not None:
            d[name] = _canonical_json(name, d[name])
    if d.get("json_schema_strict"):
        # Part of the spec, hence of the cache key (schema_coverage.STRICT_KEY).
        d["json_schema"] = json.dumps(with_strict(json.loads(d["json_schema"]), True),
                                      separators=(",", ":"), ensure_ascii=False)
    if d.get("choice") is not None:
        d["choice"] = _parse_choice(d["choice"])


def _check_value_types(d: dict) -> None:
    """The JSON types of the remaining fields (ranges are ``verify``'s); null numbers
    dropped so the defaults apply."""
    for name in ("regex", "ebnf", "custom_logit_processor"):
        if d.get(name) is not None and not isinstance(d[name], str):
            raise ValueError(f"{name} must be a string, got {d[name]!r}")
    if d.get("custom_params") is not None and not isinstance(d["custom_params"], Mapping):
        raise ValueError(f"custom_params must be a JSON object, got {d['custom_params']!r}")
    for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
        if name in d and not _is_int(d[name]):
            raise ValueError(f"{name} must be an integer, got {d[name]!r}")
    if d.get("seed") is not None and not _is_int(d["seed"]):
        raise ValueError(f"seed must be an integer, got {d['seed']!r}")
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        if d.get(name, 0) is None:
            d.pop(name)
        elif name in d and (isinstance(d[name], bool) or not isinstance(d[name], (int, float))):
            raise ValueError(f"{name} must be a number, got {d[name]!r}")
    for name in ("ignore_eos", "skip_special_tokens"):
        if name in d and not isinstance(d[name], bool):
            raise ValueError(f"{name} must be a boolean, got {d[name]!r}")


def _canonical_json(name: str, value: Any) -> str:
    """An object or JSON text -> compact JSON text, so equal specs share one cache entry.
    Key order is kept: it decides the order in which properties are generated."""
    if isinstance(value, str):
        value = load_json_text(value, name)  # depth, errors and surrogates checked
    else:
        where = lone_surrogate_path(value)
        if where is not None:
            raise ValueError(f"{name} contains a lone UTF-16 surrogate at {where}: strings "
                             "must be valid Unicode.")
    check_no_external_refs(value, name)  # a 400 before anything is queued
    if name == "json_schema" and not isinstance(value, (Mapping, bool)):
        raise ValueError(f"json_schema must be a JSON object, got {type(value).__name__}")
    if name == "structural_tag" and not isinstance(value, Mapping):
        raise ValueError(f"structural_tag must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _parse_choice(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"choice must be a non-empty list of strings, got {raw!r}")
    if not all(isinstance(c, str) and c for c in raw):
        raise ValueError("choice must be a list of non-empty strings")
    if len(raw) > _MAX_CHOICES:
        raise ValueError(f"choice may list at most {_MAX_CHOICES} strings, got {len(raw)}")
    return tuple(raw)


def _parse_logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """{token id (int or decimal string, as in OpenAI's JSON): bias} -> sorted pairs."""
    if raw is None:
        return ()
    if isinstance(raw, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in raw):
        raw = dict(raw)
    if not isinstance(raw, Mapping):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {raw!r}")
    out = {}
    for key, bias in raw.items():
        if _is_int(key):
            tok = key
        elif isinstance(key, str) and _DECIMAL.fullmatch(key.strip()):
            tok = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {key}")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


_DECIMAL = re.compile(r"-?[0-9]{1,18}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
