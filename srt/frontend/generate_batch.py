"""Batched /generate bodies (SGLang's): ``text`` as a list of strings, or ``input_ids`` as a
list of token-id lists, is a batch of prompts.

Each of the per-prompt fields below may then be a list with one value per prompt, or one
value for all: ``sampling_params``, ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num``, ``custom_logit_processor``, ``rid``. A string ``rid`` names the batch:
prompt k's id is ``{rid}_{k}`` (SGLang's rule). The batch is split here into one ordinary
body per prompt; the native route runs them together (srt/entrypoints/routes/native.py).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

MAX_BATCH = 1024  # prompts in one request, as /v1/completions (each is a request inside)
PER_PROMPT = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
              "custom_logit_processor", "rid")


def batch_size(d: Any) -> Optional[int]:
    """The number of prompts of a batched body; None for a one-prompt body."""
    if not isinstance(d, Mapping):
        return None
    text, ids = d.get("text"), d.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return len(ids)
    return None


def split_batch(d: Mapping[str, Any]) -> Optional[list[dict]]:
    """One body per prompt of a batched body, in order; None for a one-prompt body.
    Raises ValueError (a 400) for a batch that is empty, too large or whose lists do not
    match its size."""
    size = batch_size(d)
    if size is None:
        return None
    kind = "text" if isinstance(d.get("text"), list) else "input_ids"
    if d.get("text") is not None and d.get("input_ids") is not None:
        raise ValueError("Exactly one of text or input_ids must be given.")
    if size == 0:
        raise ValueError(f"{kind} is an empty list: give at least one prompt.")
    if size > MAX_BATCH:
        raise ValueError(f"{kind} is a batch of {size} prompts; at most {MAX_BATCH} fit in one "
                         "request: split it into several requests.")
    for name in PER_PROMPT:
        v = d.get(name)
        if isinstance(v, list) and len(v) != size:
            raise ValueError(f"{name} is a list of {len(v)} values for a batch of {size} prompts: "
                             "give one value per prompt, or one value for all.")
    items = []
    for k in range(size):
        item = {**d, kind: d[kind][k]}
        for name in PER_PROMPT:
            v = d.get(name)
            if isinstance(v, list):
                item[name] = v[k]
            elif name == "rid" and isinstance(v, str):
                item[name] = f"{v}_{k}"
        items.append(item)
    return items
