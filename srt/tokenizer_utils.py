"""Tokenizer loading and chat templating for the frontend process (local files only)."""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence


def get_tokenizer(path: str, chat_template_path: Optional[str] = None):
    """Load a Hugging Face tokenizer from a local directory (or a ``.gguf`` file).

    ``local_files_only`` because the server must never reach a model hub at run time.
    ``chat_template_path`` (``--chat-template``) replaces the tokenizer's own template.
    """
    from transformers import AutoTokenizer

    if path is None:
        raise ValueError("No tokenizer path given (resolve the model path first).")
    if os.path.isfile(path) and path.endswith(".gguf"):
        # Unconverted GGUF: transformers reads the tokenizer straight from the file.
        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), local_files_only=True
        )
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template_path:
        with open(chat_template_path, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok


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
