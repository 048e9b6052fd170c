"""Prompts for bench_serving, built here from fixed word lists (no downloads).

- ``random`` (default): an instruction about a topic, then filler sentences from a random
  one on, so prompts share only a few tokens of prefix and the radix cache cannot flatter
  the figures (SGLang's random dataset, with real words).
- ``shared-prefix``: one long system prompt (``--sp-system-len`` tokens) in front of every
  request, then a distinct question of ``--sp-question-len`` tokens (SGLang's
  generated-shared-prefix): what the radix cache is for.
- ``multi-turn``: conversations whose every turn resends the whole history (the earlier
  questions and the model's own answers) plus a new question; bench_serving sends each
  conversation's turns one after another.

Lengths are approximate tokens (TOKENS_PER_WORD); the results report the server's counts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

TOKENS_PER_WORD = 1.15  # SmolLM2's tokenizer on the text below, measured
TOPICS = ["the ocean", "compilers", "bread baking", "black holes", "chess openings", "honey bees",
          "the Roman empire", "solar panels", "jazz", "volcanoes", "public transport", "origami",
          "the immune system", "rainforests", "typography", "glaciers"]
INSTRUCTIONS = ["Write a short essay about {}.", "Explain {} to a curious child.",
                "List surprising facts about {}.", "Summarise the history of {}.",
                "Describe how an expert thinks about {}.", "Write a story that involves {}."]
FILLER = [
    "The notes below were collected over several weeks by a small team of volunteers.",
    "Some of them are careful and precise, while others were written in a hurry.",
    "Please read everything before you answer, and ignore any repeated sentences.",
    "The library closes at six, so most of the work happened in the early morning.",
    "One member kept a diary of the weather, which turned out to be surprisingly useful.",
    "Another insisted on checking every date twice against the printed archive.",
    "When two sources disagreed, the team wrote both versions down side by side.",
    "A few pages were lost when the window was left open during a storm in April.",
    "The final answer should be clear, friendly and free of unnecessary jargon.",
    "Where a fact is uncertain, say so plainly instead of guessing with confidence."]
SCHEMAS = [  # (what to ask for, schema): small, realistic, always completable
    ("a person", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "age", "tags"]}),
    ("a product", {"type": "object", "properties": {
        "id": {"type": "integer"}, "title": {"type": "string"}, "price": {"type": "number"},
        "in_stock": {"type": "boolean"}}, "required": ["id", "title", "price", "in_stock"]}),
    ("a calendar event", {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "kind": {"enum": ["meeting", "party", "trip"]}}, "required": ["title", "date", "kind"]}),
]


@dataclass
class Request:
    prompt: str
    max_new_tokens: int
    schema: Optional[dict] = None
    conversation: Optional[int] = None  # multi-turn: which conversation; turns go in order


def random_requests(args) -> list[Request]:
    rnd, gen, n = random.Random(args.seed), np.random.default_rng(args.seed), args.num_prompts
    # Uniform in [ratio * len, len], as SGLang's random dataset draws them.
    in_lens = gen.integers(int(args.input_len * args.range_ratio), args.input_len + 1, n)
    out_lens = gen.integers(max(1, int(args.output_len * args.range_ratio)), args.output_len + 1, n)
    constrained = set(rnd.sample(range(n), round(args.json_schema_share * n)))  # exact share
    reqs = []
    for i in range(n):
        schema, topic = rnd.choice(SCHEMAS) if i in constrained else None, rnd.choice(TOPICS)
        head = (f"Return a JSON object describing {schema[0]} related to {topic}." if schema
                else rnd.choice(INSTRUCTIONS).format(topic))
        words, start = head.split(), rnd.randrange(len(FILLER))
        target = max(len(words), round(in_lens[i] / TOKENS_PER_WORD))
        while len(words) < target:
            words += FILLER[start % len(FILLER)].split()
            start += 1
        reqs.append(Request(" ".join(words[:target]), int(out_lens[i]), schema and schema[1]))
    return reqs


def filler_words(rnd: random.Random, n_tokens: int, start: Optional[int] = None) -> list[str]:
    words, i = [], rnd.randrange(len(FILLER)) if start is None else start
    while len(words) < round(n_tokens / TOKENS_PER_WORD):
        words += FILLER[i % len(FILLER)].split()
        i += 1
    return words[:round(n_tokens / TOKENS_PER_WORD)]


def shared_prefix_requests(args) -> list[Request]:
    rnd = random.Random(args.seed)
    system = "You are the archive's assistant. " + " ".join(filler_words(rnd, args.sp_system_len, 0))
    reqs = []
    for i in range(args.num_prompts):
        topic = TOPICS[i % len(TOPICS)]
        question = f"Question {i}: " + rnd.choice(INSTRUCTIONS).format(topic) + " "
        question += " ".join(filler_words(rnd, max(0, args.sp_question_len - 12)))
        reqs.append(Request(system + "\n\n" + question, args.output_len))
    return reqs


def multi_turn_question(rnd: random.Random, turn: int) -> str:
    return f"Turn {turn}: " + rnd.choice(INSTRUCTIONS).format(rnd.choice(TOPICS))


def multi_turn_requests(args) -> list[Request]:
    """The first turn of each conversation; bench_serving builds the later ones from the
    answers (multi_turn_question)."""
    rnd = random.Random(args.seed)
    return [Request(" ".join(filler_words(rnd, args.input_len)) + "\n" + multi_turn_question(rnd, 0),
                    args.output_len, conversation=i) for i in range(args.num_prompts)]


def make_requests(args) -> list[Request]:
    return {"random": random_requests, "shared-prefix": shared_prefix_requests,
            "multi-turn": multi_turn_requests}[args.dataset](args)
