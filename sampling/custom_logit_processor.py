"""Per-request custom logit processors (SGLang's ``custom_logit_processor`` feature).

A request names a processor by a JSON string ``{"callable": "package.module:ClassName"}``
(what ``MyProcessor.to_str()`` returns) plus optional ``custom_params``. The server imports
that class and instantiates it with no arguments.

Unlike SGLang, which ships the class as dill-pickled bytes, we never unpickle code sent by a
client: that would let anyone who can reach the port run arbitrary code on the server. The
class must therefore be importable on the server (installed, or on its PYTHONPATH), and the
feature is off unless the server starts with ``--enable-custom-logit-processor`` (importing
a module still runs its top-level code, so only enable it for trusted module sets).
"""
from __future__ import annotations

import abc
import functools
import importlib
import json
from typing import Any, Optional

import torch

from constrained.json_input import load_json_text


class CustomLogitProcessor(abc.ABC):
    """Subclass, define ``__call__``, and keep the class at module level of an importable
    module. Instances are cached and shared between requests: keep them stateless."""

    @abc.abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: list[Optional[dict]]) -> torch.Tensor:
        """``logits``: float32 rows [n, V] of the requests using this processor, with one
        ``custom_params`` dict (or None) per row. Return the new logits (in place is fine).
        They arrive penalized but not yet masked or biased: the grammar mask comes after,
        so a processor cannot make a token the request's constraint forbids samplable."""

    def validate_params(self, custom_params: Optional[dict], vocab_size: int) -> None:
        """Frontend hook: raise ValueError for parameters ``__call__`` could not use."""

    @classmethod
    def to_str(cls) -> str:
        """The JSON string a request carries as ``custom_logit_processor``."""
        if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
            raise ValueError(
                f"{cls.__qualname__} must be defined at module level of an importable module "
                "(the server imports it by name)."
            )
        return json.dumps({"callable": f"{cls.__module__}:{cls.__qualname__}"})

    @staticmethod
    def from_str(s: str) -> "CustomLogitProcessor":
        """Import and instantiate the processor ``s`` names (cached per string).
        Every problem is a ValueError with a message for the client (HTTP 400)."""
        if not isinstance(s, str):
            raise ValueError(f"custom_logit_processor must be a string, got {s!r}.")
        return _load(s)


@functools.lru_cache(maxsize=128)
def _load(s: str) -> CustomLogitProcessor:
    # A pure cache keyed by the string: exceptions are not cached, so a later retry (after
    # installing the module, say) can still succeed.
    try:
        spec = load_json_text(s, "custom_logit_processor")  # depth, errors, surrogates
    except TypeError as e:
        raise ValueError(f"custom_logit_processor is not valid JSON: {e}") from None
    target = spec.get("callable") if isinstance(spec, dict) else None
    if not isinstance(target, str):
        raise ValueError('custom_logit_processor must be a JSON object with a "callable" key '
                         '("package.module:ClassName"), as CustomLogitProcessor.to_str() returns.')
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f'custom_logit_processor "callable" must look like "package.module:ClassName", '
                         f"got {target!r}.")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own top-level code failing
        raise ValueError(f"custom_logit_processor: cannot import module {module_name!r} on the "
                         f"server ({type(e).__name__}: {e}).") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"custom_logit_processor: module {module_name!r} has no attribute "
                             f"{qualname!r}.")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, CustomLogitProcessor)):
        raise ValueError(f"custom_logit_processor: {target!r} is not a subclass of CustomLogitProcessor.")
    try:
        return obj()
    except Exception as e:
        raise ValueError(f"custom_logit_processor: {target!r} cannot be instantiated with no "
                         f"arguments ({type(e).__name__}: {e}).") from None


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """``custom_params={"token_ids": [...]}``: those tokens are never sampled."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[Optional[dict]]) -> torch.Tensor:
        rows, cols = [], []
        for i, params in enumerate(custom_param_list):
            if params is not None:
                ids = _token_ids(params)
                rows += [i] * len(ids)
                cols += ids
        if rows:  # one scatter for the whole group
            logits[torch.tensor(rows, device=logits.device),
                   torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    def validate_params(self, custom_params: Optional[dict], vocab_size: int) -> None:
        if custom_params is None:
            return
        bad = [t for t in _token_ids(custom_params) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"custom_params token_ids must be in [0, {vocab_size}), got {bad[0]}.")


def _token_ids(params: dict) -> list[int]:
    ids = params.get("token_ids")
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f'DisallowedTokensLogitsProcessor needs custom_params {{"token_ids": [int, ...]}}, '
                         f"got {params!r}.")
    return list(ids)


def validate_custom_logit_processor(s: str, custom_params: Optional[dict], vocab_size: int) -> CustomLogitProcessor:
    """Frontend check (HTTP 400 on ValueError): ``s`` loads and accepts ``custom_params``."""
    processor = CustomLogitProcessor.from_str(s)
    processor.validate_params(custom_params, vocab_size)
    return processor
