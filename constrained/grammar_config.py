"""Frozen options every grammar backend is built from (derived from ServerArgs once)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

# Here, not beside their users (grammar_manager, reasoner_grammar_backend): the frontend
# uses them too and does not import torch.
# --reasoning-parser's think end; qwen3.5 = qwen3-thinking (SGLang's name for the same form:
# the template opens <think> in the prompt). srt/frontend/reasoning_parser.py has the rest.
THINK_END_TOKENS = {"qwen3": "</think>", "deepseek-r1": "</think>", "qwen3.5": "</think>",
                    "qwen3-thinking": "</think>"}
# thinking_budget without a constraint: a pass-through grammar (free_grammar.py) under this
# key, so the budget rides the grammar path (TP agreement, speculation, n > 1 copies).
FREE_GRAMMAR_KEY = ("free", "")
DISABLED_MESSAGE = ("Constrained generation is disabled on this server (--grammar-backend none); "
                    "remove the {kind} constraint or restart the server with a grammar backend.")


@dataclass(frozen=True)
class JsonOptions:
    disable_any_whitespace: bool = False  # compact separators "," and ":", no whitespace
    whitespace_pattern: Optional[str] = None  # regex between JSON tokens (llguidance)
    max_whitespace: int = 16  # whitespace characters allowed between tokens (0: unbounded)
    unbounded_numbers: bool = False  # True: no default digit bounds (json_number_bounds.py)

    @classmethod
    def from_server_args(cls, server_args) -> "JsonOptions":
        return cls(server_args.constrained_json_disable_any_whitespace,
                   server_args.constrained_json_whitespace_pattern,
                   server_args.constrained_json_max_whitespace,
                   server_args.constrained_json_unbounded_numbers)


# A json_schema spec may carry per-request whitespace options (vLLM's
# ``disable_any_whitespace`` / ``whitespace_pattern``) in this root keyword: being part of
# the spec, they are part of the grammar cache key. Backends that honour it set
# ``supports_json_layout``; the others refuse such a spec rather than ignore it.
JSON_LAYOUT_KEY = "x-gramsync-json-layout"
_LAYOUT_FIELDS = ("disable_any_whitespace", "whitespace_pattern")


def json_layout(spec: str) -> Optional[dict]:
    """The per-request layout a json_schema spec carries, or None (cheap when absent)."""
    if JSON_LAYOUT_KEY not in spec:
        return None
    schema = json.loads(spec)
    if not isinstance(schema, dict) or JSON_LAYOUT_KEY not in schema:
        return None
    layout = schema[JSON_LAYOUT_KEY]
    if (not isinstance(layout, dict) or len(layout) != 1 or not set(layout) <= set(_LAYOUT_FIELDS)
            or (layout.get("disable_any_whitespace", True) is not True)
            or not isinstance(layout.get("whitespace_pattern", ""), str)):
        raise ValueError(f'{JSON_LAYOUT_KEY} must be {{"disable_any_whitespace": true}} or '
                         f'{{"whitespace_pattern": "<regex>"}}, got {layout!r}')
    return layout


def split_json_layout(spec: str, opts: JsonOptions) -> tuple[str, JsonOptions]:
    """(the spec without its per-request layout, the JSON options with it applied: the
    request's choice replaces the server's whitespace flags)."""
    layout = json_layout(spec)
    if layout is None:
        return spec, opts
    schema = {k: v for k, v in json.loads(spec).items() if k != JSON_LAYOUT_KEY}
    if "disable_any_whitespace" in layout:
        opts = dataclasses.replace(opts, disable_any_whitespace=True, whitespace_pattern=None)
    else:
        opts = dataclasses.replace(opts, disable_any_whitespace=False,
                                   whitespace_pattern=layout["whitespace_pattern"])
    return json.dumps(schema, ensure_ascii=False), opts


def with_json_layout(schema: Any, disable_any_whitespace: bool = False,
                     whitespace_pattern: Optional[str] = None) -> Any:
    """``schema`` (parsed) carrying a per-request layout (at most one of the two options)."""
    if not disable_any_whitespace and whitespace_pattern is None:
        return schema
    if isinstance(schema, bool):  # the same languages as true / false, as objects
        schema = {} if schema else {"not": {}}
    layout = {"disable_any_whitespace": True} if disable_any_whitespace else {"whitespace_pattern": whitespace_pattern}
    return {**schema, JSON_LAYOUT_KEY: layout}


@dataclass(frozen=True)
class GrammarBackendConfig:
    vocab_size: int  # the model's (logits') vocabulary size: the bitmask covers it all
    eos_token_ids: tuple[int, ...]
    json: JsonOptions = field(default_factory=JsonOptions)
    num_threads: int = 2
    cache_size: int = 1024

    @classmethod
    def from_server_args(cls, server_args, vocab_size: int,
                         eos_token_ids: tuple[int, ...]) -> "GrammarBackendConfig":
        return cls(
            vocab_size=vocab_size, eos_token_ids=tuple(eos_token_ids),
            json=JsonOptions.from_server_args(server_args),
            num_threads=server_args.grammar_compile_threads,
            cache_size=server_args.grammar_cache_size)
