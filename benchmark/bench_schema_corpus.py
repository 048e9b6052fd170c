"""JSON-schema corpus through real servers: how each grammar-backend configuration ends.

    .venv/bin/python benchmark/bench_schema_corpus.py                     # the two default configs
    .venv/bin/python benchmark/bench_schema_corpus.py --configs auto --limit 6
    .venv/bin/python benchmark/bench_schema_corpus.py --corpus benchmark/data/schema_corpus.json --strict

For each configuration a server is launched (launch.py on loopback, --disable-torch-compile
so no background compile competes for the cores), every schema of the corpus (default:
benchmark/data/real_schema_corpus.json, real schemas with their licences; the older
hand-written benchmark/data/schema_corpus.json still works) is sent at once (at most
--concurrency in flight) as an OpenAI chat request with response_format json_schema, greedy,
max_tokens 256; "strict": true only with --strict (a strict request is refused when the
schema has keywords no grammar enforces). Each request is counted twice:
  how it was served: served (200) and, from the choice's "grammar" field, exact or
  approximated (its "approximated" list names the keywords; "unknown" when the server sends
  no such field), or rejected (400);
  how it ended: valid (finish "stop", and the document validates with jsonschema against the
  schema as sent), hit max_tokens ("length"; "in a number" when cut inside a number literal,
  "in a string", elsewhere), violation (finish "schema_violation", the server's own check
  failed; its keyword and path are listed), or invalid reported as "stop" (must stay 0).
Compare rows of one run only: the figures depend on the model, the machine and the day.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import warnings
from collections import Counter

import httpx
import jsonschema

from bench_serving import free_port, launched_server

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {  # name -> launch.py flags
    "xgrammar-unbounded": "--grammar-backend xgrammar --constrained-json-unbounded-numbers",  # the old default
    "auto": "",  # the new defaults: --grammar-backend auto, bounded numbers
    "auto-unbounded": "--constrained-json-unbounded-numbers",
    "xgrammar": "--grammar-backend xgrammar",
    "llguidance": "--grammar-backend llguidance",
}
ENDINGS = ("valid", "length", "violation", "invalid_stop", "rejected_400", "error")
_NUMBER_TAIL = re.compile(r"[-+]?[0-9][0-9.eE+-]*$")


def cut_where(text: str) -> str:
    """Where a truncated JSON text stopped: "in a number" (a literal of 12+ characters),
    "in a string", or "elsewhere"."""
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and in_string:
            escaped = True
        elif ch == '"':
            in_string = not in_string
    if in_string:
        return "in a string"
    tail = _NUMBER_TAIL.search(text)
    return "in a number" if tail and len(tail.group()) >= 12 else "elsewhere"


def served_as(choice: dict) -> tuple[str, list[str]]:
    """("exact" | "approximated" | "unknown", approximated keywords) from choice["grammar"]."""
    grammar = choice.get("grammar")
    if not isinstance(grammar, dict) or "exact" not in grammar:
        return "unknown", []
    approximated = [str(a) for a in grammar.get("approximated") or []]
    return ("exact" if grammar["exact"] else "approximated"), approximated


def classify(status: int, body: dict, schema: dict) -> dict:
    """One answer: ending, detail, text, how it was served and the approximated keywords."""
    out = {"ending": "error", "detail": "", "text": "", "served": None, "approximated": []}
    if status == 400:
        return {**out, "ending": "rejected_400", "detail": body.get("error", {}).get("message", "")[:200]}
    if status != 200:
        return {**out, "detail": f"HTTP {status}: {str(body)[:200]}"}
    choice = body["choices"][0]
    text = choice["message"]["content"] or ""
    served, approximated = served_as(choice)
    out.update(text=text, served=served, approximated=approximated)
    if choice["finish_reason"] == "length":
        return {**out, "ending": "length", "detail": cut_where(text)}
    if choice["finish_reason"] == "schema_violation":
        v = choice.get("schema_violation") or {}
        return {**out, "ending": "violation",
                "detail": f"{v.get('keyword')} at {v.get('path')}: {str(v.get('message', ''))[:100]}"}
    try:
        doc = json.loads(text)
    except ValueError as e:
        return {**out, "ending": "invalid_stop", "detail": f"not JSON: {e}"}
    with warnings.catch_warnings():  # unknown $schema URIs (Snowplow's) fall back to the latest draft
        warnings.simplefilter("ignore", DeprecationWarning)
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(doc)), None)
    if error:
        return {**out, "ending": "invalid_stop",
                "detail": f"{error.validator}: {error.message[:140]} at {list(error.absolute_path)}"}
    return {**out, "ending": "valid"}


async def run_corpus(base: str, cases: list[dict], max_tokens: int, concurrency: int, strict: bool) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, case: dict) -> dict:
        json_schema = {"name": case["name"], "schema": case["schema"]}
        if strict:
            json_schema["strict"] = True
        body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "Generate a JSON document for this schema:\n"
                              + json.dumps(case["schema"])}],
                "response_format": {"type": "json_schema", "json_schema": json_schema}}
        async with gate:
            t0 = time.perf_counter()
            try:
                r = await client.post(base + "/v1/chat/completions", json=body)
                result = classify(r.status_code, r.json(), case["schema"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                result = {"ending": "error", "detail": f"{type(e).__name__}: {e}"[:200], "text": "",
                          "served": None, "approximated": []}
        return {"name": case["name"], "group": case["group"], **result, "seconds": time.perf_counter() - t0}

    async with httpx.AsyncClient(timeout=900) as client:
        return list(await asyncio.gather(*(one(client, c) for c in cases)))


def keyword_of(item: str) -> str:
    """"uniqueItems at #/properties/tags" -> "uniqueItems"."""
    return item.split(" at ", 1)[0].strip()


def print_tables(runs: dict[str, dict]) -> None:
    print("\n| config | requests | served | exact | approximated | unknown | rejected (400) | valid | "
          "hit max_tokens (in a number / in a string) | violation | invalid + stop | errors | wall s |")
    print("|" + "---|" * 13)
    for name, run in runs.items():
        res = run["results"]
        end = Counter(r["ending"] for r in res)
        srv = Counter(r["served"] for r in res if r["served"])
        cut = Counter(r["detail"] for r in res if r["ending"] == "length")
        print(f"| {name} | {len(res)} | {sum(srv.values())} | {srv['exact']} | {srv['approximated']} | "
              f"{srv['unknown']} | {end['rejected_400']} | {end['valid']} | "
              f"{end['length']} ({cut['in a number']} / {cut['in a string']}) | {end['violation']} | "
              f"{end['invalid_stop']} | {end['error']} | {run['wall_s']:.0f} |")
    groups = sorted({r["group"] for run in runs.values() for r in run["results"]})
    print("\nper group: valid/length/violation/invalid+stop/400 (exact/approximated/unknown)\n")
    print("| group | " + " | ".join(runs) + " |\n|" + "---|" * (len(runs) + 1))
    for g in groups:
        cells = []
        for run in runs.values():
            mine = [r for r in run["results"] if r["group"] == g]
            end, srv = Counter(r["ending"] for r in mine), Counter(r["served"] for r in mine)
            cells.append("/".join(str(end[k]) for k in ENDINGS[:5])
                         + f" ({srv['exact']}/{srv['approximated']}/{srv['unknown']})")
        print(f"| {g} | " + " | ".join(cells) + " |")
    for name, run in runs.items():
        keywords = Counter(keyword_of(a) for r in run["results"] for a in r["approximated"])
        if keywords:
            print(f"\n[{name}] approximated keywords: " + ", ".join(f"{k} {n}" for k, n in keywords.most_common()))
    print()
    for name, run in runs.items():
        for r in run["results"]:
            if r["ending"] != "valid":
                tail = " ".join(r["text"][-50:].split())
                print(f"  [{name}] {r['name']:36s} {r['ending']:12s} {r['detail'][:110]}  ...{tail}")


def print_validation_timing(runs: dict[str, dict], cases: list[dict]) -> None:
    """What the frontend pays per finished document (constrained/schema_validation.py, the
    server's own validator and cache): every generated text of this run, validated against
    its schema; a first call builds the validator (cold), later ones hit the cache."""
    import statistics

    sys.path.insert(0, os.path.dirname(HERE))
    from constrained.schema_validation import SchemaValidators

    schemas = {c["name"]: json.dumps(c["schema"], separators=(",", ":"), ensure_ascii=False) for c in cases}
    docs = [(schemas[r["name"]], r["text"]) for run in runs.values() for r in run["results"] if r["text"]]
    if not docs:
        return
    cold, warm, validators, seen = [], [], SchemaValidators(), set()
    for schema, text in docs:
        for i in range(21):  # the first use of a schema builds its validator
            t0 = time.perf_counter()
            try:
                validators.validate(schema, text)
            except ValueError:  # a schema the validator cannot build (the server 400s it first)
                break
            (warm if schema in seen else cold).append(time.perf_counter() - t0)
            seen.add(schema)
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    print(f"\nvalidation per finished document ({len(docs)} texts, ms): cached median "
          f"{statistics.median(warm) * 1e3:.4f} p99 {q(warm, 0.99):.4f}; first use (builds the validator) "
          f"median {statistics.median(cold) * 1e3:.3f} p99 {q(cold, 0.99):.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="xgrammar-unbounded,auto", help=f"comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--corpus", default=os.path.join(HERE, "data", "real_schema_corpus.json"))
    p.add_argument("--strict", action="store_true", help='send "strict": true (refuses schemas not enforced exactly)')
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--server-args", default="--disable-torch-compile", help="flags added to every config")
    p.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    p.add_argument("--output-json", help="write every answer's outcome here")
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    with open(args.corpus) as f:
        cases = json.load(f)["schemas"]
    cases = cases[: args.limit] if args.limit else cases
    runs = {}
    for name in names:
        flags = f"{CONFIGS[name]} {args.server_args}".strip()
        with launched_server(free_port(), flags) as base:
            t0 = time.perf_counter()
            results = asyncio.run(run_corpus(base, cases, args.max_tokens, args.concurrency, args.strict))
            runs[name] = {"flags": flags, "strict": args.strict, "results": results,
                          "wall_s": time.perf_counter() - t0}
        print(f"{name}: {dict(Counter(r['ending'] for r in results))}", flush=True)
    print_tables(runs)
    print_validation_timing(runs, cases)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
