"""Grammar backends side by side, same tokenizer (the embedded SmolLM2), same run:
xgrammar, llguidance and outlines (outlines-core).

    .venv/bin/python benchmark/bench_grammar_backends.py [--fill-cases a,b,c] [--walks 8]
        [--max-whitespace 16] [--compact-json]

1. Compile: every JSON-schema case of tests/grammar_corpus.py through each backend's own
   dispatch, with the server's JSON options (bounded whitespace unless --compact-json),
   the backends interleaved per schema so a drifting CPU hits them alike. Printed: how
   many compile / are refused; median and p90 ms of compile alone and of compile + the
   first mask ("to first mask": llguidance defers work to its first mask); medians over
   the schemas every backend compiles, with the ratio to outlines (> 1: outlines faster).
2. Mask fill: the same token sequences replayed through every backend (greedy walks on
   random logits under llguidance, --walks per schema), one fill_vocab_mask (one row of
   [1, ceil(V/32)]) timed per token: median and p99 us of a freshly compiled grammar's
   first pass (cold: llguidance and xgrammar fill caches lazily) and of its second (warm).
3. outlines corpus check, offline (no model): per json_schema / regex case, does outlines
   compile it, do its masks allow the tokens of ``example_valid`` (then EOS), does it
   refuse ``example_invalid``, and are --walks greedy random-logit walks valid per the
   case's independent validator.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib.metadata import version

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

from constrained.base_grammar_backend import InvalidGrammarObject  # noqa: E402
from constrained.bitmask_ops import allocate_token_bitmask, apply_token_bitmask_inplace, unpack_bitmask  # noqa: E402
from constrained.grammar_config import GrammarBackendConfig, JsonOptions  # noqa: E402
from constrained.registry import GRAMMAR_BACKEND_REGISTRY  # noqa: E402

BACKENDS = ("xgrammar", "llguidance", "outlines")
DEFAULT_FILL = "boolean_reason,array_of_objects,recursive_tree"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def compile_all(backends: dict, cases, vocab: int) -> dict:
    """{backend: {case name: (grammar or message, compile s, compile + first mask s)}}"""
    out = {name: {} for name in backends}
    mask = allocate_token_bitmask(1, vocab)
    for c in cases:
        for name, b in backends.items():
            t0 = time.perf_counter()
            g = b.init_value((c.kind, c.spec_str))
            t1 = time.perf_counter()
            if isinstance(g, InvalidGrammarObject):
                out[name][c.name] = (g.message, t1 - t0, None)
                continue
            g.copy().fill_vocab_mask(mask, 0)
            out[name][c.name] = (g, t1 - t0, time.perf_counter() - t0)
    return out


def walk(grammar, vocab: int, seed: int, max_tokens: int = 200) -> list[int]:
    """Greedy on random logits under the mask, until the grammar ends (EOS ids excluded)."""
    gen, mask, out = torch.Generator().manual_seed(seed), allocate_token_bitmask(1, vocab), []
    for _ in range(max_tokens):
        if grammar.is_terminated():
            break
        grammar.fill_vocab_mask(mask, 0)
        logits = torch.randn(1, vocab, generator=gen)
        apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        grammar.accept_token(token)
        out.append(token)
    return out


def fill_times(grammar, tokens: list[int], vocab: int) -> list[float]:
    """Seconds per fill_vocab_mask along ``tokens`` (stops where the grammar refuses one)."""
    mask, times = allocate_token_bitmask(1, vocab), []
    for t in tokens:
        t0 = time.perf_counter()
        grammar.fill_vocab_mask(mask, 0)
        times.append(time.perf_counter() - t0)
        if not unpack_bitmask(mask, vocab)[0, t]:
            break
        grammar.accept_token(t)
    return times


def check_outlines(compiled: dict, cases, tokenizer, vocab: int, eos: int, walks: int,
                   compact: bool) -> list[tuple]:
    def example(c, text: str) -> str:  # the corpus writes JSON with ", " and ": "
        return json.dumps(json.loads(text), separators=(",", ":")) if compact and c.kind == "json_schema" else text

    rows = []
    for c in cases:
        g = compiled[c.name][0]
        if isinstance(g, str):
            rows.append((c.name, "refused: " + g.split(": ", 1)[-1][:70], "", "", ""))
            continue
        valid = _accepts(g.copy(), tokenizer.encode(example(c, c.example_valid)) + [eos], vocab)
        invalid = _accepts(g.copy(), tokenizer.encode(example(c, c.example_invalid)) + [eos], vocab)
        texts = [tokenizer.decode([t for t in walk(g.copy(), vocab, s) if t != eos]) for s in range(walks)]
        bad = [t for t in texts if not c.is_valid(t)]
        rows.append((c.name, "compiled", "yes" if valid is True else f"NO ({valid})",
                     "yes" if invalid is not True else "NO", f"{walks - len(bad)}/{walks}"))
    return rows


def _accepts(grammar, tokens: list[int], vocab: int):
    """True, or the index of the first token the mask (or matcher) refuses."""
    mask = allocate_token_bitmask(1, vocab)
    for i, t in enumerate(tokens):
        grammar.fill_vocab_mask(mask, 0)
        if not unpack_bitmask(mask, vocab)[0, t]:
            return f"token {i}"
        grammar.accept_token(t)
    return True


def table(header: list[str], rows: list[tuple]) -> None:
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fill-cases", default=DEFAULT_FILL, help="corpus JSON cases for the mask-fill timing")
    p.add_argument("--walks", type=int, default=8, help="walks per schema (fill timing and corpus check)")
    p.add_argument("--max-whitespace", type=int, default=16)
    p.add_argument("--compact-json", action="store_true", help="--constrained-json-disable-any-whitespace")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from grammar_corpus import BY_NAME, JSON_CASES, REGEX_CASES
    from machine_floor import cpu_flags, cpu_model
    from srt.model_executor.model_loader import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    vocab, eos = len(tok), tok.eos_token_id
    config = GrammarBackendConfig(vocab, (eos,), JsonOptions(args.compact_json, None, args.max_whitespace))
    t0 = time.perf_counter()
    backends = {}
    for name in BACKENDS:
        t = time.perf_counter()
        backends[name] = GRAMMAR_BACKEND_REGISTRY[name](tok, config)
        print(f"{name} backend (tokenizer) ready in {time.perf_counter() - t:.2f} s")
    print(f"{cpu_model()} {cpu_flags()}; torch threads {torch.get_num_threads()}; vocab {vocab}; "
          f"outlines-core {version('outlines-core')}; "
          f"JSON {'compact' if args.compact_json else f'whitespace <= {args.max_whitespace}'}\n")

    res = compile_all(backends, JSON_CASES, vocab)
    ok = {n: {k for k, v in r.items() if v[2] is not None} for n, r in res.items()}
    common = set.intersection(*ok.values())
    med = {n: statistics.median(res[n][k][1] for k in common) for n in BACKENDS}
    med_first = {n: statistics.median(res[n][k][2] for k in common) for n in BACKENDS}
    rows = []
    for n in BACKENDS:
        own = [res[n][k][1] * 1e3 for k in ok[n]]
        first = [res[n][k][2] * 1e3 for k in ok[n]]
        rows.append((n, f"{len(ok[n])}/{len(JSON_CASES)}", len(JSON_CASES) - len(ok[n]),
                     f"{pct(own, .5):.1f} / {pct(own, .9):.1f}", f"{pct(first, .5):.1f} / {pct(first, .9):.1f}",
                     f"{med[n] * 1e3:.1f} / {med_first[n] * 1e3:.1f}",
                     f"{med[n] / med['outlines']:.3g} / {med_first[n] / med_first['outlines']:.3g}"))
    print(f"Compile, {len(JSON_CASES)} JSON schemas of tests/grammar_corpus.py ({len(common)} compiled by all):")
    table(["backend", "compiled", "refused", "compile ms p50 / p90", "to first mask ms p50 / p90",
           f"common {len(common)}: p50 compile / first mask ms", "ratio to outlines"], rows)

    print("\nMask fill per token (one row), same token sequences for every backend, us p50 / p99, "
          "cold (a fresh compile's first pass) and warm (second pass); ratio = warm p50 / outlines':")
    rows = []
    for name in args.fill_cases.split(","):
        if name not in common:
            print(f"  {name}: not compiled by every backend, skipped")
            continue
        seqs = [walk(res["llguidance"][name][0].copy(), vocab, s) for s in range(args.walks)]
        cells, warm_p50 = [], {}
        for n in BACKENDS:
            fresh = backends[n].init_value(("json_schema", BY_NAME[name].spec_str))
            cold, warm = ([x for s in seqs for x in fill_times(fresh.copy(), s, vocab)] for _ in range(2))
            warm_p50[n] = statistics.median(warm)
            cells.append(f"{statistics.median(cold) * 1e6:.0f} / {pct(cold, .99) * 1e6:.0f} · "
                         f"{warm_p50[n] * 1e6:.0f} / {pct(warm, .99) * 1e6:.0f}")
        rows.append((name, sum(map(len, seqs)), *(f"{cell} ({warm_p50[n] / warm_p50['outlines']:.3g})"
                                                  for cell, n in zip(cells, BACKENDS))))
    table(["schema", "tokens", *(f"{n}: cold · warm (ratio)" for n in BACKENDS)], rows)

    print("\noutlines on the corpus (offline check):")
    reg = compile_all({"outlines": backends["outlines"]}, REGEX_CASES, vocab)["outlines"]
    compiled = {**res["outlines"], **reg}
    table(["case", "outlines", "valid example accepted", "invalid example refused", "walks valid"],
          check_outlines(compiled, JSON_CASES + REGEX_CASES, tok, vocab, eos, args.walks, args.compact_json))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    for b in backends.values():
        b.shutdown()


if __name__ == "__main__":
    main()
