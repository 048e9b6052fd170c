"""Tokenizer loading (every process: frontend, ranks, compile pool; local files only) and
chat templating (the frontend)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

# tokenizer_config.json classes with no model-specific code: transformers builds them from
# tokenizer.json alone, so they load without AutoTokenizer, which first scans every model
# module of transformers (~3 s of CPU in each process that loads a tokenizer).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def get_tokenizer(path: str, chat_template_path: Optional[str] = None):
    """Load a Hugging Face tokenizer from a local directory (or a ``.gguf`` file).

    ``local_files_only`` because the server must never reach a model hub at run time.
    ``chat_template_path`` (``--chat-template``) replaces the tokenizer's own template.
    """
    import transformers  # lazy: AutoTokenizer is imported only where it is used

    if path is None:
        raise ValueError("No tokenizer path given (resolve the model path first).")
    generic = _generic_class(path)  # None for a file (.gguf) or a model-specific class
    if generic is not None:
        tok = getattr(transformers, generic).from_pretrained(path, local_files_only=True)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        # Unconverted GGUF: transformers reads the tokenizer straight from the file.
        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), local_files_only=True
        )
    else:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template_path:
        with open(chat_template_path, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok


def _generic_class(path: str) -> Optional[str]:
    """The tokenizer's class if the directory names a generic one and has tokenizer.json."""
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong with the file
    return name if name in _GENERIC_TOKENIZER_CLASSES else None


def apply_chat_template(
    tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """Render ``messages`` with the tokenizer's Jinja chat template into token ids.

    Raises ValueError (a 400 for the HTTP layer) when the model has no template or the
    template rejects the conversation (e.g. roles out of order).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "This model's tokenizer has no chat template; use /v1/completions or /generate "
            "with a raw prompt, or start the server with --chat-template FILE."
        )
    try:
        out: Any = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
    except ValueError:
        raise
    except Exception as e:  # jinja2 TemplateError and friends: the conversation is at fault
        raise ValueError(f"The chat template could not render the messages: {e}") from None
    # transformers versions differ: a list of ids, a BatchEncoding, or a batch of one.
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary
    entry (byte-level entries have one character per byte, at least one per text
    character). A text longer than context x this cannot fit, whatever it says."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(t) for t in vocab), default=1))
