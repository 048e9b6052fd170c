"""Prompts that speculative decoding is built for, shared by its tests and benchmark-style
checks: JSON extraction from a document in the prompt, rewriting a paragraph, open chat."""
from __future__ import annotations

DOCS = [
    ("Invoice 4471 from Northwind Traders, 12 Harbour Street, Portsmouth, dated 3 March 2024. "
     "Customer: Alice Johnson, alice.johnson@example.com. Items: 3 blue widgets at 4.50 each, "
     "1 red gadget at 12.00. Total due: 25.50 GBP.",
     {"type": "object", "required": ["invoice_number", "company", "address", "customer", "email"],
      "properties": {k: {"type": "string"} for k in
                     ["invoice_number", "company", "address", "customer", "email"]}}),
    ("Job posting: Senior Data Engineer at Bluefin Analytics in Rotterdam, Netherlands. "
     "Contact Maria van Dijk at careers@bluefin-analytics.nl. Salary 72,000 EUR per year, "
     "hybrid, three days in the office.",
     {"type": "object", "required": ["title", "company", "city", "contact", "email"],
      "properties": {k: {"type": "string"} for k in ["title", "company", "city", "contact", "email"]}}),
]
PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than a century. Every "
             "night its keeper climbed the spiral stairs, trimmed the wick and watched the ships "
             "pass safely through the narrow channel below.")


def extraction_messages(i: int) -> list[dict]:
    doc, _ = DOCS[i % len(DOCS)]
    return [{"role": "user", "content": f"Extract the fields as JSON.\n\n{doc}"}]


def extraction_schema(i: int) -> dict:
    return DOCS[i % len(DOCS)][1]


def rewrite_messages() -> list[dict]:
    return [{"role": "user", "content": "Repeat this paragraph exactly, but write 'tower' instead "
             f"of 'lighthouse':\n\n{PARAGRAPH}"}]
