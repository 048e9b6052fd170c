"""Speculative decoding (--speculative-algorithm NGRAM) on against off, in one run, on one
in-process scheduler compiled as served (step_breakdown.make_scheduler).

    .venv/bin/python benchmark/bench_spec.py [--rounds 3] [--dtype auto]
        [--cases extraction,rewrite,chat,mixed32] [--batch-sizes 1,4] [--server-args k=v,...]
        [--breakdown chat:4]

The scheduler is built with speculation configured and the two modes take turns on it
(``sched.spec_config`` is read per step: None is off), greedy everywhere. Cases:
- extraction: JSON under a json_schema from a document in the prompt (invoice, job posting,
  product page, bio); the values are copied verbatim from the document;
- rewrite: "rewrite this paragraph exactly, changing only X to Y" (no constraint);
- chat: open chat prompts, 128 new tokens, ignore_eos (the same length on and off);
- mixed32: 32 requests at once, 11 extraction + 11 rewrite + 10 chat.
Batch n (--batch-sizes) = n different prompts of the case submitted at once; tok/s = output
tokens / wall time from submission to the last finish. Per case and batch size: one
warm-up round off and one on (off the clock), whose greedy outputs must be identical token
for token (a MISMATCH line otherwise, also for any measured round), then --rounds rounds
alternating off / on; medians.

Per case, a detail line, then exactly one summary line, parsed by a checker:

    spec <extraction|rewrite|chat|mixed32> bs=<n> speedup <x>x accept <mean length>

speedup = median tok/s on / median tok/s off ({:.2f}); accept ({:.2f}) = output tokens per
request per decode step in the on rounds: (output tokens - requests, as each request's
first token comes from its prefill) / (decode steps x requests in them, counted as the
steps in which a request received tokens after its first). 1.00 = no gain; the detail
line gives the same figure for the off rounds, above 1 where grammar fast-forward appends
forced tokens (extraction) without speculation. Then the per-step breakdown (StepStats:
forward / sampling / grammar / scheduler ms per step) of one case's last off and on rounds
(--breakdown case:bs; default the first measured).

Targets (the issue): extraction >= 2.0x, rewrite >= 1.5x, chat and mixed32 >= 0.97x.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import machine_floor
import step_breakdown
from bench_offline import chat_prompts

MAX_RUNNING = 32  # mixed32 runs all at once
KINDS = ("extraction", "rewrite", "chat")


def _schema(**fields) -> dict:
    return {"type": "object", "properties": {k: {"type": t} for k, t in fields.items()},
            "required": list(fields), "additionalProperties": False}


# (what to extract, document, schema): every value appears verbatim in its document.
DOCUMENTS = [
    ("the invoice details", """INVOICE #INV-2024-08817
Date: March 14, 2024
From: Northwind Supply Co., 1427 Harbor Lane, Portland, OR 97209
Bill to: Maple Street Bakery, attn. Dana Whitfield, 88 Maple Street, Springfield, IL 62704
Email: accounts@maplestreetbakery.com
Items:
- 40 x Stone-ground whole wheat flour, 25 lb bag @ 18.75 = 750.00
- 12 x Unsalted butter, 36 lb case @ 96.20 = 1154.40
- 6 x Parchment sheets, box of 1000 @ 42.00 = 252.00
Subtotal: 2156.40
Tax (6.25%): 134.78
Total due: 2291.18 USD, payable within 30 days to account 4410-2287-09.""",
     _schema(invoice_number="string", invoice_date="string", vendor_name="string",
             customer_name="string", customer_email="string", billing_address="string",
             total_due="number", account_number="string")),
    ("the job posting", """Senior Backend Engineer (Payments), requisition JP-55210
Company: Brightline Logistics
Location: 500 Market Street, Suite 1200, San Francisco, CA 94105 (hybrid, 3 days on site)
Salary range: $165,000 - $195,000 per year
We are looking for an engineer to own the ledger service that settles about two million
shipments a month. You will design idempotent payment APIs in Go and PostgreSQL, share the
on-call rotation with four other engineers, and work with finance on reconciliation.
Requirements: 6 years of backend experience, production Go or Java, strong SQL.
Apply by April 30, 2024. Questions go to Priya Raman at hiring-payments@brightline-logistics.com.""",
     _schema(job_title="string", requisition_id="string", company="string", location="string",
             salary_range="string", years_of_experience="number", deadline="string",
             contact_email="string")),
    ("the product information", """Trailhead Ultralight 2-Person Tent
Model: TH-UL2-GRN | SKU: 84-3310-927
Price: $349.95 (was $399.00)
Packed weight: 1.18 kg
Rating: 4.7 out of 5 (1,284 reviews)
Sold and shipped by Trailhead Outfitters, 2200 Canyon Road, Boulder, CO 80302.
A freestanding double-wall tent with two doors and two vestibules, so nobody climbs over
anyone at night. The aluminium poles are color-coded, and the rain fly pitches first when
the weather turns. Floor: 20D ripstop nylon, 3000 mm waterproof rating.""",
     _schema(product_name="string", model_number="string", sku="string", price="number",
             weight_kg="number", rating="number", seller_address="string")),
    ("the person's profile", """Dr. Amelia Okonkwo-Reyes is a marine biologist at the Halvorsen Institute
for Ocean Research in Bergen, Norway, where she has led the Coral Resilience Lab since
2017. Born in Lagos in 1981, she earned her PhD from the University of Cape Town with a
thesis on heat tolerance in reef-building corals. Her team maintains a cold-water reef
monitoring network along the Norwegian coast. She can be reached at
a.okonkwo-reyes@halvorsen-ocean.no, and her ORCID is 0000-0002-7391-4456.""",
     _schema(full_name="string", occupation="string", employer="string", city="string",
             birth_year="number", phd_university="string", email="string", orcid="string")),
]

# (paragraph, X, Y): "rewrite exactly, changing only X to Y".
PARAGRAPHS = [
    ("""The Riverside town council met on Tuesday evening to discuss the proposed renovation of
the old library on Elm Street. Several residents spoke in favor of keeping the original brick
facade, while others argued that a modern glass entrance would make the building more
welcoming. The architect presented three designs and an estimated budget of 2.4 million
dollars, most of which would come from a state preservation grant. After two hours of debate,
the council agreed to hold a public vote on Tuesday next month and to publish all three
designs on the town website so that every resident can review them before then.""",
     "Tuesday", "Thursday"),
    ("""Anna arrived at the field station just before sunrise and checked the weather instruments
on the roof. The wind had shifted to the northwest overnight, and the pressure was falling
slowly, which usually meant rain by the afternoon. She recorded the readings in the logbook,
replaced the battery in the rain gauge, and then walked down to the river to collect water
samples from the three marked sites. By nine o'clock Anna was back inside, labeling the
bottles and packing them in ice for the afternoon courier, who would drive them to the
university laboratory in the city.""", "Anna", "Maria"),
    ("""This spring our team is releasing version 3.0 of the scheduling app, the largest update
since the first launch. Shared calendars now sync in real time across phones and laptops,
and recurring events can finally skip holidays automatically. We rebuilt the notification
system from scratch, so reminders arrive on time even when the phone is in battery saver
mode. Existing subscribers get every new feature at no extra cost, and new users can try the
full version free for thirty days. The update rolls out to all regions this spring, starting
with Europe and North America.""", "spring", "autumn"),
    ("""We reached Lisbon late on a Friday night, tired after a long train ride from Madrid. The
next morning we climbed the steep streets of the Alfama district, stopping for coffee and
custard tarts in a tiny bakery with blue tiles on every wall. In the afternoon we took the
old yellow tram along the river and watched the ferries cross to the other bank. Dinner was
grilled sardines at a family restaurant where the owner sang fado between courses. By the
end of the weekend we agreed that Lisbon deserved at least another week of our time.""",
     "Lisbon", "Porto"),
]


def case_requests(tok, kind: str, n: int, offset: int = 0) -> list[tuple[tuple[int, ...], dict]]:
    """n (prompt ids, sampling params) of one kind, prompts cycling from ``offset``."""
    from srt.tokenizer_utils import apply_chat_template

    def chat_ids(text):
        return tuple(apply_chat_template(tok, [{"role": "user", "content": text}]))

    out = []
    for i in range(offset, offset + n):
        if kind == "extraction":
            what, doc, schema = DOCUMENTS[i % len(DOCUMENTS)]
            text = f"Extract {what} as JSON with the fields {', '.join(schema['properties'])}.\n\n{doc}"
            out.append((chat_ids(text), {"temperature": 0, "max_new_tokens": 160,
                                         "json_schema": json.dumps(schema)}))
        elif kind == "rewrite":
            para, x, y = PARAGRAPHS[i % len(PARAGRAPHS)]
            text = (f"Rewrite the following paragraph exactly, changing only \"{x}\" to \"{y}\"."
                    f"\n\n{para.replace(chr(10), ' ')}")
            out.append((chat_ids(text), {"temperature": 0, "ignore_eos": False,
                                         "max_new_tokens": len(tok(para)["input_ids"]) + 20}))
        else:
            out.append((tuple(apply_chat_template(tok, chat_prompts(i + 1)[i])),
                        {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}))
    return out


def workload(tok, case: str, bs: int) -> list[tuple[tuple[int, ...], dict]]:
    if case != "mixed32":
        return case_requests(tok, case, bs)
    parts = [case_requests(tok, k, n) for k, n in zip(KINDS, (11, 11, 10))]
    return [r for group in zip(*parts) for r in group] + parts[0][10:] + parts[1][10:]  # interleaved


SPEC_COUNTERS = ("spec_verify_steps", "spec_drafted_tokens", "spec_accepted_tokens")


def run_round(sched, reqs, spec_config, tag: str) -> dict:
    """Submit every request at once and step until all are done (spec_config None: off)."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    sched.spec_config = spec_config
    sched.step_stats.reset()
    before = {k: getattr(sched.step_stats, k) for k in SPEC_COUNTERS}
    rids = [f"{tag}-{i}" for i in range(len(reqs))]
    tokens = {rid: [] for rid in rids}
    steps = dict.fromkeys(rids, 0)  # steps that gave the request tokens (prefill included)
    start = time.perf_counter()
    sched.process_input_requests([TokenizedGenerateReq(rid, ids, SamplingParams.from_dict(p), stream=True)
                                  for rid, (ids, p) in zip(rids, reqs)])
    while sched.has_work():
        for out in sched.step():
            for rid, new in zip(getattr(out, "rids", ()), getattr(out, "new_token_ids", ())):
                if new and rid in tokens:
                    tokens[rid].extend(new)
                    steps[rid] += 1
    elapsed = time.perf_counter() - start
    total = sum(len(t) for t in tokens.values())
    pairs = sum(s - 1 for s in steps.values())  # decode step x request
    return {"tok_s": total / elapsed, "tokens": [tokens[r] for r in rids], "total": total,
            "accept": (total - len(reqs)) / max(pairs, 1),
            "counters": {k: getattr(sched.step_stats, k) - before[k] for k in SPEC_COUNTERS},
            "steps": {m: (t.steps, t.per_step_ms()) for m, t in sched.step_stats.by_mode.items()}}


def check_same(ref: dict, got: dict, label: str) -> None:
    """Greedy outputs must not depend on speculation: a loud line per differing request."""
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"MISMATCH {label} request {i}: first difference at output token {at} "
                  f"(lengths {len(a)} vs {len(b)})", flush=True)


def bench_case(sched, spec_config, tok, case: str, bs: int, rounds: int) -> dict:
    reqs = workload(tok, case, bs)
    label = f"{case} bs={len(reqs)}"
    ref = run_round(sched, reqs, None, f"{case}{bs}-w0")  # warm-up, off the clock
    check_same(ref, run_round(sched, reqs, spec_config, f"{case}{bs}-w1"), f"{label} warm-up")
    res = {False: [], True: []}
    for r in range(rounds):
        for on in (False, True):
            res[on].append(run_round(sched, reqs, spec_config if on else None, f"{case}{bs}-r{r}{int(on)}"))
            check_same(ref, res[on][-1], f"{label} round {r} {'on' if on else 'off'}")
    tok_s = {on: statistics.median(x["tok_s"] for x in rs) for on, rs in res.items()}
    accept = {on: statistics.mean(x["accept"] for x in rs) for on, rs in res.items()}
    counters = {k: statistics.median(x["counters"][k] for x in res[True]) for k in SPEC_COUNTERS}
    print(f"{label}: off {tok_s[False]:7.1f} tok/s  on {tok_s[True]:7.1f} tok/s  "
          f"({res[True][0]['total']} output tokens)  per on-round: verify steps "
          f"{counters['spec_verify_steps']:.0f} drafted {counters['spec_drafted_tokens']:.0f} "
          f"accepted {counters['spec_accepted_tokens']:.0f}  tokens/request/decode step "
          f"off {accept[False]:.2f} on {accept[True]:.2f}")
    print(f"spec {case} bs={len(reqs)} speedup {tok_s[True] / tok_s[False]:.2f}x accept {accept[True]:.2f}",
          flush=True)
    return {"label": label, "steps": {on: rs[-1]["steps"] for on, rs in res.items()}}


def main():
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cases", default="extraction,rewrite,chat,mixed32")
    p.add_argument("--batch-sizes", default="1,4", help="for extraction, rewrite and chat")
    p.add_argument("--server-args", default="", help="extra ServerArgs as k=v,k=v (e.g. speculative_num_draft_tokens=4)")
    p.add_argument("--breakdown", default="", help="case:bs whose per-step breakdown is printed "
                   "(default: the first measured), e.g. chat:4")
    args = p.parse_args()
    from srt.model_executor.model_loader import resolve_model_path
    from srt.model_executor.model_runner import cpu_has_native_bf16

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    extra = dict(kv.split("=") for kv in args.server_args.split(",") if kv)
    extra = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in extra.items()}
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={dtype} "
          f"threads={torch.get_num_threads()} {extra}", flush=True)
    extra.setdefault("speculative_algorithm", "NGRAM")  # the config to toggle must exist
    # --dtype as the server takes it (auto: what it serves; the weights line says which).
    sched = step_breakdown.make_scheduler(resolve_model_path(None), args.dtype, MAX_RUNNING, **extra)
    spec_config = sched.spec_config
    weights = "the GGUF's 4-bit codes" if sched.runner.gguf_int4 else "dense"
    print(f"weights: {weights}; {spec_config}; medians of {args.rounds} rounds", flush=True)
    cases = [c for c in args.cases.split(",") if c]
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    shown = [bench_case(sched, spec_config, sched.tokenizer, case, bs, args.rounds)
             for case in cases for bs in ([32] if case == "mixed32" else sizes)]
    want = args.breakdown.replace(":", " bs=")
    pick = next((x for x in shown if x["label"] == want), shown[0] if shown else None)
    if pick:
        print(f"\nper-step breakdown, {pick['label']}, last round "
              "(ms per step: forward / sampling / grammar / scheduler)")
        for on in (False, True):
            for mode, (steps, ms) in sorted(pick["steps"][on].items()):
                print(f"spec {'on ' if on else 'off'} {mode:7s} {steps:5d} steps  "
                      + "  ".join(f"{k} {v:6.1f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
