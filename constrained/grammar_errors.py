"""Grammar library errors as the user sees them. Torch-free: the frontend's strict checks
report compile errors too, and the frontend does not import torch."""
from __future__ import annotations

import re

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "
_MAX_ERROR_CHARS = 1000


def clean_error(e: BaseException) -> str:
    """A library exception as one readable line for the user's 400."""
    text = _CPP_PREFIX.sub("", str(e).strip()) or type(e).__name__
    text = " ".join(text.split())  # multi-line parser errors -> one line
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + " ..."
