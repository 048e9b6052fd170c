"""``oneOf`` over closed objects whose branches overlap, made exact by narrowing each branch.

llguidance enforces ``oneOf`` only when it can prove the branches disjoint (by type or
``const``) and refuses the schema otherwise; xgrammar reads ``oneOf`` as ``anyOf``, so a
document matching two branches -- invalid under ``oneOf`` -- can come out. For branches
that are closed objects (``properties`` plus ``additionalProperties: false``, as
``close_objects`` makes them) the overlap is decided by key sets alone, so each branch B_i
is narrowed to a subset B_i' that no other (original) branch B_j admits:

* a key B_i requires is not allowed in B_j, or B_j requires a key B_i does not allow:
  already disjoint;
* else B_i allows a key B_j does not: B_i' requires it;
* else B_j requires a key B_i does not: B_i' may not contain it;
* else every B_i document's keys fit B_j: B_i' is empty (the branch is dropped).

Every document of ``anyOf: [B_1', ...]`` then matches exactly one original branch: the
language is a subset of the ``oneOf`` (some valid documents are lost, none invalid gained).
Value schemas are never compared, so the argument holds whatever they are.
"""
from __future__ import annotations

from typing import Any, Optional

_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default"})
# Keywords next to which key sets no longer decide what an object admits.
_KEY_SHAPERS = frozenset({"patternProperties", "allOf", "anyOf", "oneOf", "$ref", "not", "if",
                          "dependentRequired", "dependentSchemas", "dependencies", "minProperties",
                          "maxProperties", "propertyNames", "unevaluatedProperties"})


def _resolve(root: Any, node: Any, hops: int = 8) -> Any:
    """Follow local ``#/a/b`` references (a few hops) to the schema they name."""
    while (hops and isinstance(node, dict) and set(node) - _ANNOTATIONS == {"$ref"}
           and str(node["$ref"]).startswith("#")):
        target: Any = root
        for part in filter(None, node["$ref"][1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        node, hops = target, hops - 1
    return node


def _closed_object(node: Any) -> Optional[tuple[list[str], set[str]]]:
    """(property names in order, required names) of a closed object schema, else None."""
    if (not isinstance(node, dict) or node.get("type", "object") != "object" or _KEY_SHAPERS & set(node)
            or node.get("additionalProperties") is not False or not isinstance(node.get("properties"), dict)):
        return None
    required = node.get("required", [])
    return list(node["properties"]), set(required) if isinstance(required, list) else set()


def _narrow(branches: list[dict], shapes: list[tuple[list[str], set[str]]]) -> list[dict]:
    narrowed = []
    for i, (props, req) in enumerate(shapes):
        add, remove, drop = [], set(), False
        for j, (other_props, other_req) in enumerate(shapes):
            if i == j or req - set(other_props) or other_req - set(props):
                continue
            extra = [k for k in props if k not in other_props]
            if extra:
                add.append(extra[0])
            elif other_req - req:
                remove.add(min(other_req - req))
            else:
                drop = True
        if drop or remove & set(add):
            continue
        branch = {**branches[i], "type": "object"}  # without "type" a branch also admits non-objects
        branch["properties"] = {k: v for k, v in branch["properties"].items() if k not in remove}
        branch["required"] = [k for k in props if k in req or k in add]
        narrowed.append(branch)
    return narrowed


def exclusive_one_of(schema: Any) -> Optional[Any]:
    """A copy of ``schema`` with every ``oneOf`` of closed objects rewritten to a disjoint
    ``anyOf``; None when no ``oneOf`` could be rewritten."""
    changed = []

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in _DATA_KEYS else walk(v)) for k, v in node.items()}
        options = out.get("oneOf")
        if isinstance(options, list) and options and "anyOf" not in out:
            branches = [_resolve(schema, b) for b in options]
            shapes = [_closed_object(b) for b in branches]
            if all(shapes):
                narrowed = _narrow(branches, shapes)
                if narrowed:
                    del out["oneOf"]
                    out["anyOf"] = narrowed
                    changed.append(True)
        return out

    rewritten = walk(schema)
    return rewritten if changed else None
