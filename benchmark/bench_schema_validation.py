"""Full-schema validation of finished documents: jsonschema vs jsonschema-rs vs fastjsonschema.

    .venv/bin/python benchmark/bench_schema_validation.py             # 80 corpus schemas
    .venv/bin/python benchmark/bench_schema_validation.py --array-items 20   # larger documents

For every schema of benchmark/data/schema_corpus.json the script generates a valid document
(every property filled in, arrays of --array-items items, strings from the schema's pattern,
format or enum; checked with the reference implementation, python-jsonschema) and an invalid
one (the last leaf that can be broken given a value of the wrong type, so the validator walks
the whole document).
Each library is configured as the server would use it: no network for $ref, the formats the
grammar libraries constrain asserted where the library can, meta-validation of the schema at
build. Timed per schema (median of --repeats), then median and p99 over the schemas:

- build: schema text -> validator (json.loads of the schema included);
- cold: build + the first validation (python-jsonschema resolves $refs and compiles its regexes
  lazily, so its build alone is misleading);
- valid / invalid: document text -> verdict (json.loads + validation, and for an invalid one
  the first error turned into keyword, instance path and schema path).

Then a coverage matrix of hand-written checks (keyword, instance and schema path reported), the
drafts each library documents, and the same figures for constrained/schema_validation.py (the
chosen library behind an LRU cache). A library that is not installed is skipped with a note.
Compare figures of one run only; they depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

try:
    from re import _parser as sre  # Python 3.11+
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as sre  # type: ignore

ASSERTED_FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                    "uuid", "uri")
DENIED = "http://127.0.0.1:9/remote.json"  # the discard port: nothing leaves the machine


def cpu_line() -> str:
    try:
        from machine_floor import cpu_flags, cpu_model  # the shared helper (imports torch)
        flags = cpu_flags()
        return f"{cpu_model()}, {os.cpu_count()} cores; " + ", ".join(
            f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
    except ImportError:
        return f"{os.cpu_count()} cores; flags unknown"


def pointer(parts) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _deny(uri: str):
    raise LookupError(f"remote reference refused: {uri}")


# ---- the three libraries, configured as the server would use them ---------------------------
class Lib:
    name = ""
    drafts = ""  # as each library documents them

    def build(self, schema_text: str) -> Any: ...
    def check(self, validator: Any, text: str) -> Optional[tuple]: ...  # (msg, kw, path, spath)


class JsonschemaRs(Lib):
    """Through constrained/schema_validation.py's own build and error mapping."""
    name, drafts = "jsonschema-rs", "4, 6, 7, 2019-09, 2020-12"

    def __init__(self):
        import jsonschema_rs
        from constrained import schema_validation as sv
        self.sv, self.rs = sv, jsonschema_rs

    def build(self, schema_text):
        v = self.sv._build(schema_text)
        if isinstance(v, str):
            raise ValueError(v)
        return v

    def check(self, v, text):
        try:
            v.validate(json.loads(text))
        except self.rs.ValidationError as e:
            return (e.message, self.sv._keyword(e), pointer(e.instance_path), pointer(e.schema_path))
        return None


class PyJsonschema(Lib):
    name, drafts = "jsonschema", "3, 4, 6, 7, 2019-09, 2020-12"

    def __init__(self):
        import jsonschema
        from referencing import Registry
        self.js = jsonschema
        self.registry = Registry(retrieve=_deny)  # else it fetches http refs (deprecated path)
        self.checkers = {}  # validator class -> its draft's checker, cut to ASSERTED_FORMATS

    def format_checker(self, cls):
        if cls not in self.checkers:  # date-time, uri, hostname, duration need extra packages
            checker = self.js.FormatChecker(formats=())
            checker.checkers = {k: v for k, v in cls.FORMAT_CHECKER.checkers.items() if k in ASSERTED_FORMATS}
            self.checkers[cls] = checker
        return self.checkers[cls]

    def build(self, schema_text):
        schema = json.loads(schema_text)
        cls = self.js.validators.validator_for(schema, default=self.js.Draft202012Validator)
        cls.check_schema(schema)  # meta-validation, as jsonschema-rs does at build
        return cls(schema, registry=self.registry, format_checker=self.format_checker(cls))

    def check(self, v, text):
        e = next(v.iter_errors(json.loads(text)), None)
        if e is None:
            return None
        return (e.message, e.validator, pointer(e.absolute_path), pointer(e.absolute_schema_path))


class FastJsonschema(Lib):
    name, drafts = "fastjsonschema", "4, 6, 7 (2019-09: its formats only)"

    def __init__(self):
        import fastjsonschema
        self.f = fastjsonschema
        self.handlers = {s: _deny for s in ("http", "https", "file", "ftp")}  # else urlopen

    def build(self, schema_text):
        return self.f.compile(json.loads(schema_text), handlers=self.handlers, use_formats=True)

    def check(self, v, text):
        try:
            v(json.loads(text))
        except self.f.JsonSchemaValueException as e:
            return (e.message, e.rule, pointer((e.path or ["data"])[1:]), "-")  # no schema path
        return None


LIBS = (JsonschemaRs, PyJsonschema, FastJsonschema)


# ---- documents --------------------------------------------------------------------------------
FORMAT_SAMPLES = {"date-time": "2024-05-01T12:30:00Z", "date": "2024-05-01", "time": "12:30:00Z",
                  "duration": "P1DT2H", "email": "user@example.com", "hostname": "example.com",
                  "ipv4": "192.168.0.1", "ipv6": "2001:db8::1", "uri": "https://example.com/a",
                  "uuid": "123e4567-e89b-12d3-a456-426614174000"}
_CATEGORY = {"CATEGORY_DIGIT": "0123456789", "CATEGORY_WORD": "abcdefghij", "CATEGORY_SPACE": " ",
             "CATEGORY_NOT_SPACE": "abcdefghij", "CATEGORY_NOT_DIGIT": "abcdefghij",
             "CATEGORY_NOT_WORD": "-"}


def regex_sample(pattern: str, k: int = 0) -> Optional[str]:
    """A short string the pattern matches (variant ``k``), or None."""
    def chars(items) -> str:
        out = ""
        for op, av in items:
            op = str(op)
            if op == "LITERAL":
                out += chr(av)
            elif op == "RANGE":
                out += "".join(chr(c) for c in range(av[0], min(av[1], av[0] + 25) + 1))
            elif op == "CATEGORY":
                out += _CATEGORY.get(str(av), "")
        return out

    def gen(items) -> str:
        s = ""
        for op, av in items:
            op = str(op)
            if op == "LITERAL":
                s += chr(av)
            elif op in ("NOT_LITERAL", "ANY"):
                s += "a" if av != ord("a") else "b"
            elif op == "IN":
                if str(av[0][0]) == "NEGATE":
                    s += next(c for c in "axz0_" if c not in chars(av[1:]))
                else:
                    pool = chars(av)
                    s += pool[k % len(pool)]
            elif op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, _hi, sub = av
                s += gen(sub) * lo
            elif op == "SUBPATTERN":
                s += gen(av[-1])
            elif op == "BRANCH":
                s += gen(av[1][0])
            elif op in ("AT", "ASSERT", "ASSERT_NOT"):
                pass
            else:
                return s
        return s

    import re
    try:
        s = gen(sre.parse(pattern))
        return s if re.search(pattern, s) else None
    except (re.error, StopIteration, IndexError, ZeroDivisionError):
        return None


class DocGen:
    array_items = 2  # items per array (at least minItems, at most maxItems): --array-items

    def __init__(self, schema: dict, reference):
        self.root, self.ref, self.minimal = schema, reference, False

    def resolve(self, node):
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            target: Any = self.root
            for part in [p for p in node["$ref"][1:].split("/") if p]:
                target = target[part.replace("~1", "/").replace("~0", "~")]
            node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return node

    def merge(self, a: dict, b) -> dict:
        b = self.resolve(b)
        if not isinstance(b, dict):
            return a
        out = {**a, **b}
        if "properties" in a and "properties" in b:
            out["properties"] = {**a["properties"], **b["properties"]}
        if "required" in a and "required" in b:
            out["required"] = list(dict.fromkeys(a["required"] + b["required"]))
        return out

    def gen(self, node, k=0, depth=0):
        node = self.resolve(node)
        if node is True or node == {}:
            return f"v{k}"
        if not isinstance(node, dict) or depth > 12:
            return None
        if "allOf" in node:
            merged = {kk: v for kk, v in node.items() if kk != "allOf"}
            for sub in node["allOf"]:
                merged = self.merge(merged, sub)
            return self.gen(merged, k, depth)
        if "if" in node:  # the branch the generated document takes
            base = {kk: v for kk, v in node.items() if kk not in ("if", "then", "else")}
            for branch in ("then", "else"):
                value = self.gen(self.merge(base, node.get(branch, {})), k, depth)
                if value is not None and self.ref.evolve(schema=node).is_valid(value):
                    return value
            return None
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return node["enum"][k % len(node["enum"])]
        for key in ("oneOf", "anyOf"):
            if key in node:
                base = {kk: v for kk, v in node.items() if kk != key}
                for branch in node[key]:
                    value = self.gen(self.merge(base, branch), k, depth)
                    if value is not None and self.ref.evolve(schema=node).is_valid(value):
                        return value
                return None
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        t = next((x for x in types if x and x != "null"), types[0] if types[0] else None)
        if t is None:
            t = ("object" if {"properties", "patternProperties", "required"} & node.keys() else
                 "array" if {"items", "prefixItems"} & node.keys() else
                 "string" if {"pattern", "format", "minLength"} & node.keys() else
                 "number" if {"minimum", "maximum"} & node.keys() else "null")
        return getattr(self, "gen_" + t)(node, k, depth)

    def gen_object(self, node, k, depth):
        out, required = {}, node.get("required", [])
        for name, sub in node.get("properties", {}).items():
            if self.minimal and name not in required:
                continue
            value = self.gen(sub, k, depth + 1)
            if value is None and name in required:
                return None
            if value is not None:
                out[name] = value
        extra = node.get("additionalProperties", True)
        for pattern, sub in node.get("patternProperties", {}).items():
            if not out or len(out) < node.get("minProperties", 0):
                key = regex_sample(pattern, k)
                if key is not None:
                    out[key] = self.gen(sub, k, depth + 1)
        if isinstance(extra, dict) and not node.get("properties") and not out:
            out.update({f"key{i}": self.gen(extra, i, depth + 1) for i in range(2)})
        for name in required:
            out.setdefault(name, self.gen(extra if isinstance(extra, dict) else True, k, depth + 1))
        return out

    def gen_array(self, node, k, depth):
        prefix = node.get("prefixItems") or (node["items"] if isinstance(node.get("items"), list) else [])
        out = [self.gen(sub, k + i, depth + 1) for i, sub in enumerate(prefix)]
        items = node.get("items") if isinstance(node.get("items"), (dict, bool)) else node.get("additionalItems", True)
        if items is not False and (not prefix or items is not True):
            want = max(node.get("minItems", 0), min(self.array_items, node.get("maxItems", self.array_items)))
            out += [self.gen(items if isinstance(items, dict) else True, k + i, depth + 1)
                    for i in range(len(out), want)]
        return out

    def gen_string(self, node, k, depth):
        if node.get("format") in FORMAT_SAMPLES:
            return FORMAT_SAMPLES[node["format"]]
        if isinstance(node.get("pattern"), str):
            return regex_sample(node["pattern"], k)
        s = f"text {k}" + "x" * max(0, node.get("minLength", 0) - 6)
        return s[: node["maxLength"]] if "maxLength" in node else s

    def _bounds(self, node):
        lo, hi = node.get("minimum"), node.get("maximum")
        xlo, xhi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
        if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
            lo = xlo + 1
        if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
            hi = xhi - 1
        return lo, hi

    def gen_integer(self, node, k, depth):
        lo, hi = self._bounds(node)
        v = int(-(-lo // 1)) + k if lo is not None else min(7 + k, int(hi) if hi is not None else 7 + k)
        step = node.get("multipleOf", 1)
        return int(-(-v // step) * step) if isinstance(step, int) else v

    def gen_number(self, node, k, depth):
        lo, hi = self._bounds(node)
        if "multipleOf" in node:
            return self.gen_integer(node, k, depth)
        if lo is not None and hi is not None:
            return (lo + hi) / 2
        return lo + 0.5 + k if lo is not None else (hi - 0.5 if hi is not None else 2.5 + k)

    def gen_boolean(self, node, k, depth):
        return k % 2 == 0

    def gen_null(self, node, k, depth):
        return None


def leaves(doc, path=()):
    if isinstance(doc, dict):
        for key, v in doc.items():
            yield from leaves(v, path + (key,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from leaves(v, path + (i,))
    else:
        yield path


def broken(doc, path):
    if not path:
        return 12345 if isinstance(doc, str) else "wrong"
    copy = json.loads(json.dumps(doc))
    target = copy
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = broken(target[path[-1]], ())
    return copy


def corpus_documents(schemas, ref_lib) -> list[tuple[str, str, Optional[str], Optional[str]]]:
    """(name, schema_text, valid_text, invalid_text) per schema; None where none was found."""
    out = []
    for entry in schemas:
        text = json.dumps(entry["schema"])
        ref = ref_lib.build(text)
        valid = invalid = None
        for minimal in (False, True):
            gen = DocGen(entry["schema"], ref)
            gen.minimal = minimal
            try:
                doc = gen.gen(entry["schema"])
            except (KeyError, TypeError, RecursionError):
                continue
            if ref.is_valid(doc):
                valid = doc
                break
        if valid is not None:
            for path in reversed(list(leaves(valid))):
                if not ref.is_valid(bad := broken(valid, path)):
                    invalid = bad
                    break
        if invalid is None:
            invalid = [] if isinstance(valid, dict) else {}
        out.append((entry["name"], text, None if valid is None else json.dumps(valid), json.dumps(invalid)))
    return out


# ---- timing -----------------------------------------------------------------------------------
def timed(fn: Callable, repeats: int) -> float:
    """Median seconds of ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def bench_lib(lib: Lib, docs, repeats: int) -> dict:
    build, cold, valid, invalid, wrong, failed = [], [], [], [], [], []
    for name, schema, ok_text, bad_text in docs:
        try:
            v = lib.build(schema)
        except Exception as e:  # noqa: BLE001 - a library refusing a corpus schema is a result
            failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        build.append(timed(lambda: lib.build(schema), max(3, repeats // 10)))
        cold.append(timed(lambda: lib.check(lib.build(schema), ok_text or bad_text), max(3, repeats // 10)))
        if ok_text is not None:
            valid.append(timed(lambda: lib.check(v, ok_text), repeats))
            if lib.check(v, ok_text) is not None:
                wrong.append(f"{name}: valid doc rejected: {lib.check(v, ok_text)[0][:80]}")
        invalid.append(timed(lambda: lib.check(v, bad_text), repeats))
        if lib.check(v, bad_text) is None:
            wrong.append(f"{name}: invalid doc accepted")
    return {"build": build, "cold": cold, "valid": valid, "invalid": invalid, "wrong": wrong, "failed": failed}


def bench_wrapper(docs, repeats: int) -> dict:
    """constrained/schema_validation.py end to end: cache hit + validation + violation."""
    from constrained.schema_validation import SchemaValidators
    sv = SchemaValidators()
    valid, invalid = [], []
    for _name, schema, ok_text, bad_text in docs:
        sv.validate(schema, bad_text)
        if ok_text is not None:
            valid.append(timed(lambda: sv.validate(schema, ok_text), repeats))
        invalid.append(timed(lambda: sv.validate(schema, bad_text), repeats))
    return {"valid": valid, "invalid": invalid}


# ---- coverage ---------------------------------------------------------------------------------
SNOWPLOW = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
D7 = "http://json-schema.org/draft-07/schema#"
CHECKS = [  # (name, schema, valid doc, invalid doc, keyword, instance path, schema path)
    ("uniqueItems", {"properties": {"tags": {"type": "array", "uniqueItems": True}}},
     {"tags": [1, 2]}, {"tags": [1, 1]}, "uniqueItems", "#/tags", "#/properties/tags/uniqueItems"),
    ("not", {"properties": {"a": {"not": {"type": "string"}}}}, {"a": 1}, {"a": "s"},
     "not", "#/a", "#/properties/a/not"),
    ("oneOf two match", {"oneOf": [{"type": "integer"}, {"minimum": 0}]}, -1, 3, "oneOf", "#", "#/oneOf"),
    ("if/then/else", {"if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["b"]},
                      "else": {"required": ["c"]}}, {"k": 1, "b": 0}, {"k": 1, "c": 0},
     "required", "#", "#/then/required"),
    ("dependentRequired", {"dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1},
     "dependentRequired", "#", "#/dependentRequired"),
    ("propertyNames", {"propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"Ab": 1},
     "pattern", "#", "#/propertyNames/pattern"),
    ("patternProperties", {"patternProperties": {"^x-": {"type": "integer"}}}, {"x-a": 1}, {"x-a": "s"},
     "type", "#/x-a", "#/patternProperties/^x-/type"),
    ("unevaluatedProperties", {"properties": {"a": {}}, "unevaluatedProperties": False},
     {"a": 1}, {"a": 1, "b": 2}, "unevaluatedProperties", "#", "#/unevaluatedProperties"),
    ("$ref to $defs", {"$defs": {"t": {"maxLength": 3}}, "properties": {"a": {"items": {"$ref": "#/$defs/t"}}}},
     {"a": ["abc"]}, {"a": ["ab", "abcd"]}, "maxLength", "#/a/1", "#/$defs/t/maxLength"),
    ("prefixItems (2020-12)", {"prefixItems": [{"type": "integer"}], "items": False}, [1], [1, 2],
     "items", "#/1", "#/items"),
    ("unknown $schema=2020-12", {"$schema": SNOWPLOW, "prefixItems": [{"type": "integer"}]}, [1], ["x"],
     "type", "#/0", "#/prefixItems/0/type"),
    ("draft-07 dependencies", {"$schema": D7, "dependencies": {"a": ["b"]}}, {"a": 1, "b": 1}, {"a": 1},
     "dependencies", "#", "#/dependencies"),
] + [(f"format {f}", {"format": f}, FORMAT_SAMPLES[f], bad, "format", "#", "#/format") for f, bad in (
    ("date-time", "2024-05-01 12:30"), ("date", "2024-02-30"), ("time", "25:00:00Z"),
    ("email", "not-an-email"), ("uuid", "123e4567-e89b-12d3-a456"), ("ipv4", "256.1.1.1"),
    ("hostname", "-bad-.com"), ("uri", "not a uri"), ("duration", "1 day"))] + [
    ("contentEncoding (draft 7)", {"$schema": D7, "contentEncoding": "base64"}, "aGk=", "!!!",
     "contentEncoding", "#", "#/contentEncoding"),
]


def coverage(lib: Lib, check) -> str:
    name, schema, good, bad, kw, path, spath = check
    try:
        v = lib.build(json.dumps(schema))
        good_err, bad_err = lib.check(v, json.dumps(good)), lib.check(v, json.dumps(bad))
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}"
    if good_err is not None:
        return f"WRONG (rejects valid: {good_err[1]})"
    if bad_err is None:
        return "NOT ENFORCED"
    got = [("kw=" + str(bad_err[1])) if bad_err[1] != kw else "",
           ("path=" + bad_err[2]) if bad_err[2] != path else "",
           ("spath=" + bad_err[3]) if bad_err[3] != spath else ""]
    return "ok" if not any(got) else "ok, " + " ".join(g for g in got if g)


def remote_ref(lib: Lib) -> str:
    schema = json.dumps({"properties": {"a": {"$ref": DENIED}}})
    t, where = time.perf_counter(), "build"
    try:
        v = lib.build(schema)
        where = "validate"  # python-jsonschema resolves $refs lazily
        if lib.check(v, '{"a": 1}') is None:
            return "ACCEPTED (ref ignored?)"
        return "reported as a violation at validate"
    except Exception as e:  # noqa: BLE001
        ms = 1e3 * (time.perf_counter() - t)
        return f"refused at {where} in {ms:.1f} ms ({type(e).__name__}: {str(e).splitlines()[0][:60]})"


# ---- report -----------------------------------------------------------------------------------
def us(x):
    return f"{1e6 * x:,.0f}" if x >= 1e-5 else f"{1e6 * x:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30, help="timed calls per schema and document")
    p.add_argument("--chosen", default="jsonschema-rs", help="the row the ratios are taken to")
    p.add_argument("--schemas", type=int, default=0, help="first N corpus schemas (0: all)")
    p.add_argument("--array-items", type=int, default=2, help="items per array in the documents")
    a = p.parse_args()
    DocGen.array_items = a.array_items
    libs = []
    for cls in LIBS:
        try:
            libs.append(cls())
        except ImportError as e:
            print(f"# {cls.name}: not installed, skipped ({e})")
    with open(os.path.join(HERE, "data", "schema_corpus.json")) as f:
        schemas = json.load(f)["schemas"]
    schemas = schemas[: a.schemas] if a.schemas else schemas
    ref = next((lib for lib in libs if lib.name == "jsonschema"), None)
    if ref is None:
        sys.exit("python-jsonschema is needed as the reference that checks the generated documents")
    docs = corpus_documents(schemas, ref)
    n_valid = sum(d[2] is not None for d in docs)
    sizes = [len(d[2]) for d in docs if d[2] is not None]
    print(f"# CPU: {cpu_line()}; Python {sys.version.split()[0]}")
    print(f"# {len(docs)} corpus schemas; valid documents generated for {n_valid} "
          f"(median {statistics.median(sizes):.0f} B, max {max(sizes)} B), invalid for {len(docs)}; "
          f"per schema the median of {a.repeats} calls (build/cold: {max(3, a.repeats // 10)}), "
          f"then median / p99 over the schemas, in microseconds")
    missing = [d[0] for d in docs if d[2] is None]
    if missing:
        print(f"# no valid document generated for: {', '.join(missing)}")
    rows = {}
    for lib in libs:
        rows[lib.name] = bench_lib(lib, docs, a.repeats)
    chosen = rows.get(a.chosen)

    def cell(xs):
        return f"{us(statistics.median(xs))} / {us(p99(xs))}" if xs else "-"

    def ratio(name, key):
        if not chosen or not rows[name][key] or not chosen[key]:
            return "-"
        return f"{statistics.median(rows[name][key]) / statistics.median(chosen[key]):.1f}x"

    print("\n| library | version | drafts (docs) | build | cold (build + 1st) | validate valid | "
          "validate invalid + error | wrong verdicts | build / chosen | valid / chosen | invalid / chosen |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lib in libs:
        r = rows[lib.name]
        try:
            ver = version(lib.name)
        except PackageNotFoundError:
            ver = "?"
        print(f"| {lib.name} | {ver} | {lib.drafts} | {cell(r['build'])} | {cell(r['cold'])} | "
              f"{cell(r['valid'])} | {cell(r['invalid'])} | {len(r['wrong']) + len(r['failed'])} | "
              f"{ratio(lib.name, 'build')} | {ratio(lib.name, 'valid')} | {ratio(lib.name, 'invalid')} |")
    if any(lib.name == "jsonschema-rs" for lib in libs):
        w = bench_wrapper(docs, a.repeats)
        print(f"| SchemaValidators (cache hit) | - | - | - | - | {cell(w['valid'])} | "
              f"{cell(w['invalid'])} | - | - | - | - |")
    for lib in libs:
        for line in rows[lib.name]["failed"] + rows[lib.name]["wrong"]:
            print(f"#   {lib.name}: {line}")

    print("\n| check | " + " | ".join(lib.name for lib in libs) + " |")
    print("|---|" + "---|" * len(libs))
    for check in CHECKS:
        print(f"| {check[0]} | " + " | ".join(coverage(lib, check) for lib in libs) + " |")
    print("| remote $ref (no network) | " + " | ".join(remote_ref(lib) for lib in libs) + " |")
    print("\n# ok = enforced, reports the expected keyword, instance path and schema path (a JSON "
          "pointer into the schema document); otherwise what it reported instead. Formats: "
          f"asserted {', '.join(ASSERTED_FORMATS)} where the library can.")


if __name__ == "__main__":
    main()
