"""Loads this folder's JSONL files for the gramsync lm-eval tasks (``custom_dataset`` in
their YAML), so the tasks read only local files, whatever the working directory, and
nothing is fetched from a hub."""
from __future__ import annotations

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def load_jsonl(data_file: str, **_metadata) -> dict[str, datasets.Dataset]:
    """``{"test": Dataset}`` from ``data_file`` (a JSONL file next to this module). lm-eval
    passes the task's ``metadata`` as keyword arguments too: ignored."""
    with open(os.path.join(HERE, data_file), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}
