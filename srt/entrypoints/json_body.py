"""Parse a client's JSON body into something every later stage can handle, or a 400:
nesting measured first, clear messages for malformed JSON, no lone surrogates
(``constrained.json_input.load_json_text``)."""
from __future__ import annotations

from typing import Any

from constrained.json_input import load_json_text


def parse_json_body(body: bytes) -> Any:
    try:
        return load_json_text(body, "The request body")
    except ValueError as e:
        raise ValueError(str(e).replace("The request body is not valid JSON:", "Malformed JSON body:")) from None
