"""JSON-schema corpus through real servers: how each grammar-backend configuration ends.

    .venv/bin/python benchmark/bench_schema_corpus.py                     # the two default configs
    .venv/bin/python benchmark/bench_schema_corpus.py --configs xgrammar-unbounded,auto,auto-unbounded

For each configuration a server is launched (launch.py on loopback, --disable-torch-compile
so no background compile competes for the cores), every schema of
benchmark/data/schema_corpus.json is sent at once (at most --concurrency in flight) as an
OpenAI chat request with response_format json_schema, greedy, max_tokens 256, and each
answer is counted as: valid document ending "stop" (checked with jsonschema against the
schema as sent), "length" (max_tokens hit; "in a number" when it was cut inside a number
literal, "in a string", elsewhere), 400 (refused), or an invalid document reported as "stop". Compare rows of one run
only: the figures depend on the model, the machine and the day.
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
OUTCOMES = ("valid_stop", "length", "rejected_400", "invalid_stop", "error")
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


def classify(status: int, body: dict, schema: dict) -> tuple[str, str, str]:
    """(outcome, detail, text) of one answer."""
    if status == 400:
        return "rejected_400", body.get("error", {}).get("message", "")[:200], ""
    if status != 200:
        return "error", f"HTTP {status}: {str(body)[:200]}", ""
    choice = body["choices"][0]
    text = choice["message"]["content"] or ""
    if choice["finish_reason"] == "length":
        return "length", cut_where(text), text
    try:
        doc = json.loads(text)
    except ValueError as e:
        return "invalid_stop", f"not JSON: {e}", text
    with warnings.catch_warnings():  # unknown $schema URIs (Snowplow's) fall back to the latest draft
        warnings.simplefilter("ignore", DeprecationWarning)
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(doc)), None)
    detail = f"{error.message[:160]} at {list(error.absolute_path)}" if error else ""
    return ("invalid_stop" if error else "valid_stop"), detail, text


async def run_corpus(base: str, cases: list[dict], max_tokens: int, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, case: dict) -> dict:
        body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "Generate a JSON document for this schema:\n"
                              + json.dumps(case["schema"])}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": case["name"], "schema": case["schema"], "strict": True}}}
        async with gate:
            t0 = time.perf_counter()
            try:
                r = await client.post(base + "/v1/chat/completions", json=body)
                outcome, detail, text = classify(r.status_code, r.json(), case["schema"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                outcome, detail, text = "error", f"{type(e).__name__}: {e}"[:200], ""
        return {"name": case["name"], "group": case["group"], "outcome": outcome, "detail": detail,
                "text": text, "seconds": time.perf_counter() - t0}

    async with httpx.AsyncClient(timeout=900) as client:
        return list(await asyncio.gather(*(one(client, c) for c in cases)))


def print_tables(runs: dict[str, dict]) -> None:
    head = "| config | requests | valid + stop | length (in a number / in a string) | 400 | invalid + stop | errors | wall s |"
    print("\n" + head + "\n|" + "---|" * 8)
    for name, run in runs.items():
        c = Counter(r["outcome"] for r in run["results"])
        cut = Counter(r["detail"] for r in run["results"] if r["outcome"] == "length")
        print(f"| {name} | {len(run['results'])} | {c['valid_stop']} | "
              f"{c['length']} ({cut['in a number']} / {cut['in a string']}) | "
              f"{c['rejected_400']} | {c['invalid_stop']} | {c['error']} | {run['wall_s']:.0f} |")
    groups = sorted({r["group"] for run in runs.values() for r in run["results"]})
    print("\nper group: valid/length/400/invalid\n\n| group | " + " | ".join(runs) + " |\n|" + "---|" * (len(runs) + 1))
    for g in groups:
        cells = []
        for run in runs.values():
            c = Counter(r["outcome"] for r in run["results"] if r["group"] == g)
            cells.append("/".join(str(c[k]) for k in OUTCOMES[:4]))
        print(f"| {g} | " + " | ".join(cells) + " |")
    for name, run in runs.items():
        for r in run["results"]:
            if r["outcome"] != "valid_stop":
                tail = " ".join(r["text"][-50:].split())
                print(f"  [{name}] {r['name']:24s} {r['outcome']:12s} {r['detail'][:100]}  ...{tail}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="xgrammar-unbounded,auto", help=f"comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--corpus", default=os.path.join(HERE, "data", "schema_corpus.json"))
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
            results = asyncio.run(run_corpus(base, cases, args.max_tokens, args.concurrency))
            runs[name] = {"flags": flags, "results": results, "wall_s": time.perf_counter() - t0}
        print(f"{name}: {dict(Counter(r['outcome'] for r in results))}", flush=True)
    print_tables(runs)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
