"""How deeply a JSON text nests, found without parsing it (so without recursion).

Python's ``json`` parser, pydantic and the grammar compilers all recurse; a body nested
20,000 levels deep would reach them as a RecursionError (a 500). Every JSON text from a
client -- the request body, and a schema sent as a string -- is measured first and
refused past ``MAX_JSON_DEPTH`` with a 400. The scan runs at C speed: string literals
are cut out with one regex, the brackets kept with ``bytes.translate``, and the depth is
the maximum of their running sum.
"""
from __future__ import annotations

import re
from typing import Union

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
