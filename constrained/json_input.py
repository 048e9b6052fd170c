"""Loading JSON text from a client: depth first (without recursion), clear errors, and
no lone surrogates.

How deeply a JSON text nests is found without parsing it.

Python's ``json`` parser, pydantic and the grammar compilers all recurse; a body nested
20,000 levels deep would reach them as a RecursionError (a 500). Every JSON text from a
client -- the request body, and a schema sent as a string -- is measured first and
refused past ``MAX_JSON_DEPTH`` with a 400. The scan runs at C speed: string literals
are cut out with one regex, the brackets kept with ``bytes.translate``, and the depth is
the maximum of their running sum.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

import numpy as np

MAX_JSON_DEPTH = 128  # arrays/objects; real requests and schemas stay far below

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class JsonTooDeep(ValueError):
    pass


def json_depth(text: Union[bytes, str]) -> int:
    """The deepest nesting of arrays/objects (brackets inside strings do not count)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = _OPEN[np.frombuffer(brackets, dtype=np.uint8)].astype(np.int32)
    return int(np.cumsum(steps).max())


def check_json_depth(text: Union[bytes, str], what: str = "The request body",
                     limit: int = MAX_JSON_DEPTH) -> None:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:  # fast path: it cannot nest deeper
        return
    depth = json_depth(data)
    if depth > limit:
        raise JsonTooDeep(f"{what} is nested too deeply: {depth} levels of arrays/objects, "
                          f"at most {limit} are allowed.")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_STR = re.compile(r"\\u[dD][89a-fA-F]")
_LONE = re.compile("[\ud800-\udfff]")


def load_json_text(text: Union[bytes, str], what: str) -> Any:
    """``json.loads`` for client input: ValueError with a message naming ``what`` for
    nesting past MAX_JSON_DEPTH, malformed JSON (also Python's 4,300-digit integer limit)
    and lone UTF-16 surrogates (valid JSON escapes, but not Unicode: the tokenizer, msgpack
    and every reply would fail on them later)."""
    check_json_depth(text, what)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        reason = ("a number has more than 4300 digits" if "digits" in str(e)
                  else "it is not UTF-8 text")
        raise ValueError(f"{what} is not valid JSON: {reason}.") from None
    if isinstance(text, bytes):  # UTF-8 cannot hold a surrogate: only an escape can
        suspicious = _SURROGATE_ESCAPE.search(text)
    else:
        suspicious = _LONE.search(text) or _SURROGATE_ESCAPE_STR.search(text)
    if suspicious:
        where = lone_surrogate_path(obj)
        if where is not None:
            raise ValueError(f"{what} contains a lone UTF-16 surrogate (an unpaired "
                             f"\\ud800-\\udfff escape) at {where}: strings must be valid Unicode.")
    return obj


def lone_surrogate_path(obj: Any) -> Optional[str]:
    """The JSON path of the first string (value or key) holding a lone surrogate."""
    stack: list[tuple[Any, str]] = [(obj, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _LONE.search(node):
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and _LONE.search(k):
                    return f"{path} (a key)"
                stack.append((v, f"{path}.{k}"))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None
