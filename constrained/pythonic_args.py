"""Codec for the pythonic tool-call format (``pythonic``: Llama 3.2 / Llama 4).

Calls are a Python list of calls with keyword arguments: ``[f(a=1, b="x"), g()]``, values as
Python literals. We write strings in JSON's double-quoted form (valid Python with the same
meaning: ``json.dumps`` never emits ``\\/``, and ``ensure_ascii=False`` avoids surrogate
pairs, which Python would read as two lone surrogates).
"""
from __future__ import annotations

import ast
import json
import keyword
import math
from typing import Any

# Shared rules for ``kwargs_grammar``. Escapes are the intersection of JSON's and Python's
# (no ``\\/``; ``\\u`` outside the surrogate range), so a matched string means the same to both.
_BASE_RULES = r'''
py_str ::= "\"" ([^"\\\0-\x1f] | "\\" (["\\bfnrt] | "u" py_bmp))* "\""
py_bmp ::= [0-9a-cA-Ce-fE-F] py_hex py_hex py_hex | [dD] [0-7] py_hex py_hex
py_hex ::= [0-9a-fA-F]
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_num ::= py_int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
py_bool ::= "True" | "False"
py_none ::= "None"
py_any ::= py_str | py_num | py_bool | py_none | py_list | py_dict
py_list ::= "[" (py_any (", " py_any)*)? "]"
py_dict ::= "{" (py_str ": " py_any (", " py_str ": " py_any)*)? "}"
'''
_TYPE_RULES = {"string": "py_str", "integer": "py_int", "number": "py_num",
               "boolean": "py_bool", "null": "py_none", "object": "py_dict"}


def render_calls(calls: list[tuple[str, dict]]) -> str:
    """``[f(a=1, b="x"), g()]`` for ``(name, arguments)`` pairs of decoded JSON; keyword order
    is the dict's. Raises ValueError for a name or key Python cannot spell, or a non-finite
    float."""
    out = []
    for name, args in calls:
        if not all(p.isidentifier() and not keyword.iskeyword(p) for p in name.split(".")):
            raise ValueError(f"tool name {name!r} cannot be written as a Python call")
        for key in args:
            _check_keyword(key)
        kwargs = ", ".join(f"{k}={_literal(v)}" for k, v in args.items())
        out.append(f"{name}({kwargs})")
    return "[" + ", ".join(out) + "]"


def _check_keyword(key: Any) -> None:
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
        raise ValueError(f"argument name {key!r} is not a Python identifier")


def _literal(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} has no Python literal")
    if isinstance(value, (str, int, float)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(str(k))}: {_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"cannot write a {type(value).__name__} as a tool argument")


def parse_calls(text: str) -> list[tuple[str, dict]]:
    """Parse ``[f(a=1), g(b="x")]`` into ``(name, arguments)`` pairs of JSON-able values.

    Accepts only a list of calls to (dotted) names with keyword arguments whose values are
    literals; tuples become lists, sets / bytes / complex and non-string dict keys are
    rejected. Raises ValueError naming what is wrong."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"tool calls are not valid Python: {e.msg}") from None
    if not isinstance(tree, ast.List):
        raise ValueError("tool calls must be a list: [f(a=1), g()]")
    calls = []
    for i, node in enumerate(tree.elts):
        if not isinstance(node, ast.Call):
            raise ValueError(f"element {i} of the list is not a call")
        name = _dotted_name(node.func)
        if name is None:
            raise ValueError(f"call {i} is not to a plain function name")
        if node.args:
            raise ValueError(f"call {i} ({name}) has positional arguments; keywords only")
        args: dict = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"call {i} ({name}) uses **kwargs")
            if kw.arg in args:
                raise ValueError(f"call {i} ({name}) repeats argument {kw.arg!r}")
            try:
                args[kw.arg] = _jsonable(ast.literal_eval(kw.value))
            except ValueError as e:
                raise ValueError(f"call {i} ({name}) argument {kw.arg!r}: {e}") from None
        calls.append((name, args))
    return calls


def _dotted_name(node: ast.AST):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a JSON number")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("dict keys must be strings")
        return {k: _jsonable(v) for k, v in value.items()}
    raise ValueError(f"a {type(value).__name__} is not a JSON value")


def kwargs_grammar(schema: dict) -> str:
    """An xgrammar EBNF grammar (rule ``root``) for the text between ``f(`` and ``)``.

    Properties are written ``key=value``, joined by ``", "``, in the schema's property order;
    required ones always, optional ones optional (each item starts with its distinct
    ``key=``, so the grammar is unambiguous). Values follow the property's ``type`` (a list
    of types or ``anyOf`` / ``oneOf`` as alternatives), ``enum`` / ``const`` as literal
    alternatives, typed array items; objects and anything else take a generic Python literal.
    It is an APPROXIMATION: no ``additionalProperties``, lengths, ranges, patterns or nested
    object keys, so validate the parsed arguments against the full schema afterwards (see
    ``kwargs_grammar_is_exact``). Raises ValueError for a property Python cannot spell."""
    props = (schema or {}).get("properties") or {}
    required = set((schema or {}).get("required") or [])
    rules: list[str] = []
    keys = list(props)
    for i, key in enumerate(keys):
        _check_keyword(key)
        rules.append(f'p_{i} ::= "{key}=" {_value_expr(props[key], rules)}')
    # kw_i: the items from i on, none written yet; tl_i: the same after one was written.
    # Each item starts with its own "key=", so every choice is decided by one lookahead.
    root = '""'
    for i in range(len(keys) - 1, -1, -1):
        req = keys[i] in required
        nxt = f" tl_{i + 1}" if i + 1 < len(keys) else ""
        if i:  # kw_0 is the root; nothing precedes item 0
            rules.append(f'tl_{i} ::= ' + (f'", " p_{i}{nxt}' if req else f'("" | ", " p_{i}){nxt}'))
        rules.append(f"kw_{i} ::= p_{i}{nxt}" + ("" if req else f" | {root}"))
        root = f"kw_{i}"
    return f"root ::= {root}\n" + "\n".join(rules) + _BASE_RULES


def kwargs_grammar_is_exact(schema: dict) -> bool:
    """Whether ``kwargs_grammar(schema)`` accepts exactly the schema's valid arguments: never
    claimed (always False), so callers always validate after ``parse_calls``."""
    return False


def _value_expr(schema: Any, rules: list[str]) -> str:
    """An EBNF expression for one value; nested array items get their own rule."""
    if not isinstance(schema, dict):
        return "py_any"
    members = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(members, list) and members and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in members):
        return "(" + " | ".join(dict.fromkeys(json.dumps(_literal(v)) for v in members)) + ")"
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and "type" not in schema:
        return "(" + " | ".join(_value_expr(b, rules) for b in branches) + ")"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types:
        return "py_any"
    alts = []
    for t in types:
        if t == "array" and isinstance(schema.get("items"), dict):
            name = f"arr_{len(rules)}"
            rules.append("")  # reserve the name before nested rules take later indices
            elem = _value_expr(schema["items"], rules)
            rules[int(name[4:])] = f'{name} ::= "[" ({elem} (", " {elem})*)? "]"'
            alts.append(name)
        else:
            alts.append(_TYPE_RULES.get(t, "py_list" if t == "array" else "py_any"))
    return "(" + " | ".join(alts) + ")"
