"""Grammar inputs never reach out: only local ``#...`` references are allowed in a schema.

A ``$ref`` to a URL or a file would make the server fetch (or read) something the client
chose: server-side request forgery, local file disclosure, and a compile that waits on
the network. Checked where the frontend parses a schema (``SamplingParams``: a 400 before
anything is queued) and again in every grammar backend's dispatch, so plugins and
callers that build specs themselves are covered too.
"""
from __future__ import annotations

import json
from typing import Any, Union

REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
# Values under these keys are data, not schemas: a "$ref" there is just a string...
DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
# ...except inside maps from names to schemas, where "enum" or "default" is just a name.
NAMED_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                               "dependentSchemas", "dependencies"})


class ExternalRefError(ValueError):
    pass


def check_no_external_refs(schema: Union[str, Any], kind: str = "json_schema") -> None:
    """Raise ExternalRefError naming the first reference that is not ``#...`` (iterative:
    a deeply nested schema cannot exhaust the stack)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return  # not JSON: the backend reports that
    # (node, its JSON path, whether it is a name -> schema map)
    stack: list[tuple[Any, str, bool]] = [(schema, "#", False)]
    while stack:
        node, path, named = stack.pop()
        if isinstance(node, dict):
            for key in REF_KEYS:
                ref = node.get(key)
                if isinstance(ref, str) and not ref.startswith("#") and not named:
                    shown = path if len(path) <= 200 else path[:100] + "/.../" + path[-95:]
                    raise ExternalRefError(
                        f"{kind} {key} {ref[:200]!r} at {shown} is not a local reference: only "
                        "references within the schema ('#/...') are allowed; the server never "
                        "fetches URLs or reads files for a schema.")
            for k, v in node.items():
                if (named or k not in DATA_KEYS) and isinstance(v, (dict, list)):
                    stack.append((v, f"{path}/{k}", not named and k in NAMED_SCHEMA_MAPS))
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}", False) for i, v in enumerate(node)
                         if isinstance(v, (dict, list)))
