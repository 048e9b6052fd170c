"""Which ``--tool-call-parser`` a model's chat template calls for.

``detect_tool_call_parser(template)`` reads the literal text of a chat template and names the
SGLang tool-call parser whose format the template writes for an assistant turn with
``tool_calls``, with a one-line reason naming the marker it found. ``(None, reason)`` when no
known marker is there; the caller then falls back to ``hermes`` and logs the reason.

The checks run from the most specific marker to the least, because several families share
markers: Qwen3-Coder / Qwen3.5 / Qwen3.6 write ``<tool_call>`` like Hermes but with
``<function=..>`` / ``<parameter=..>`` inside; DeepSeek-V3 and V3.1 share every special
token and differ only in V3's fenced ```` ```json```` arguments (and its ``function`` type before
``<｜tool▁sep｜>``); Hermes templates list tools with a ``"parameters"`` key like Llama's, so
Llama is recognised only together with its header tokens.
"""
from __future__ import annotations

from typing import Optional

DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_TOOL_SEP = "<｜tool▁sep｜>"


def detect_tool_call_parser(chat_template: Optional[str]) -> tuple[Optional[str], str]:
    """``(parser name or None, human reason)`` for a chat template's text.

    Names are SGLang's: ``qwen3_coder``, ``deepseekv3``, ``deepseekv31``, ``mistral``,
    ``pythonic``, ``llama3``, ``hermes``.
    """
    if not chat_template:
        return None, "the model has no chat template"
    t = chat_template

    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder", "chat template writes <function= and <parameter= (Qwen3-Coder XML)"

    if DEEPSEEK_CALLS_BEGIN in t or DEEPSEEK_TOOL_SEP in t:
        if "```json" in t or f"function{DEEPSEEK_TOOL_SEP}" in t:
            return "deepseekv3", (
                f"chat template writes {DEEPSEEK_TOOL_SEP} with ```json-fenced arguments (DeepSeek-V3)"
            )
        return "deepseekv31", (
            f"chat template writes NAME{DEEPSEEK_TOOL_SEP}ARGUMENTS without a ```json fence (DeepSeek-V3.1)"
        )

    if "[TOOL_CALLS]" in t and "[ARGS]" in t:
        return "mistral_v11", "chat template writes [TOOL_CALLS]NAME[ARGS] (Mistral v11+)"
    if "[TOOL_CALLS]" in t:
        return "mistral", "chat template writes [TOOL_CALLS] and a JSON list (Mistral v3)"

    if "[func_name1(" in t or "python list of the calls" in t or "python list for function calls" in t:
        return "pythonic", "chat template asks for a python list of calls [func_name1(...)] (Llama 3.2 / Llama 4 pythonic)"

    if "<|python_tag|>" in t:
        return "llama3", "chat template writes <|python_tag|> (Llama 3.1 / 3.3 JSON)"
    llama_headers = "<|start_header_id|>" in t or "<|header_start|>" in t
    if llama_headers and '"parameters"' in t:
        return "llama3", 'chat template writes {"name": ..., "parameters": ...} in Llama headers (Llama 3 JSON)'

    if "<tool_call>" in t:
        return "hermes", "chat template writes <tool_call> (Hermes / Qwen2.5 JSON)"

    return None, "no known tool-call marker in the chat template"
