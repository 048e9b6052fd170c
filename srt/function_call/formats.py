"""Tool-call text formats (``--tool-call-parser``, SGLang's names): how calls look in each
model family's output. docs/tools.md has the table of formats and families.

A format is a handful of literal strings (and the style its arguments are written in), so
the same strings build the grammar (grammar.py), render history (prompt.py) and drive the
parser (parser.py): the three always agree. Calls are

    calls_begin  call_begin NAME args_begin ARGS call_end  (separator  call ...)  calls_end

where ``calls_begin`` / ``calls_end`` wrap all of one turn's calls (Mistral v3's JSON list,
DeepSeek's ``<｜tool▁calls▁begin｜>``, the pythonic list) or are empty (each call stands
alone: Hermes, Qwen3-Coder, Llama 3, Mistral v11).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from srt.function_call.format_prompts import (DEEPSEEK_PROMPT, HERMES_SYSTEM_PROMPT, LLAMA3_PROMPT,
                                              MISTRAL_PROMPT, MISTRAL_V11_PROMPT, PYTHONIC_PROMPT, QWEN3_CODER_PROMPT)

ARG_STYLES = ("json", "qwen_xml", "pythonic")


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    call_begin: str
    args_begin: str
    call_end: str
    separator: str
    system_prompt: str  # str.format template with {tools}: one JSON tool per line
    calls_begin: str = ""
    calls_end: str = ""
    args_style: str = "json"  # json | qwen_xml (strings raw) | pythonic (Python keyword arguments)
    # xgrammar's built-in structural tag for the family (xgrammar.get_model_structural_tag),
    # used for auto and named tool_choice; None where xgrammar has none (grammar.py says why).
    builtin: Optional[str] = None
    auto_trigger: Optional[str] = None  # the grammar's auto trigger, where xgrammar's built-in has a shorter one
    call_id_style: str = "openai"  # openai: call_<24 hex>; mistral9: 9 alphanumerics (its templates require them)
    result_begin: str = "<tool_response>\n"  # a tool's result, as a user turn, for templates without tool roles
    result_end: str = "\n</tool_response>"

    @property
    def wrapped(self) -> bool:
        return bool(self.calls_begin)

    @property
    def trigger(self) -> str:
        """What starts the grammar in ``auto``: the wrapper, else a call's fixed head."""
        return self.calls_begin or self.call_begin

    def render_tools(self, tools: list[dict]) -> str:
        return self.system_prompt.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _fmt(name: str, **kw) -> ToolCallFormat:
    return ToolCallFormat(name=name, **kw)


HERMES = _fmt("hermes", call_begin='<tool_call>\n{"name": "', args_begin='", "arguments": ',
              call_end="}\n</tool_call>", separator="\n", system_prompt=HERMES_SYSTEM_PROMPT, builtin="qwen_3",
              auto_trigger="<tool_call>")
QWEN3_CODER = _fmt("qwen3_coder", call_begin="<tool_call>\n<function=", args_begin=">\n",
                   call_end="\n</function>\n</tool_call>", separator="\n", args_style="qwen_xml",
                   system_prompt=QWEN3_CODER_PROMPT, builtin="qwen_3_coder")
LLAMA3 = _fmt("llama3", call_begin='{"name": "', args_begin='", "parameters": ', call_end="}",
              separator="; ", system_prompt=LLAMA3_PROMPT, builtin="llama", auto_trigger='{"name": ',
              result_begin="", result_end="")
PYTHONIC = _fmt("pythonic", calls_begin="[", call_begin="", args_begin="(", call_end=")", separator=", ",
                calls_end="]", args_style="pythonic", system_prompt=PYTHONIC_PROMPT, result_begin="", result_end="")
MISTRAL = _fmt("mistral", calls_begin="[TOOL_CALLS][", call_begin='{"name": "', args_begin='", "arguments": ',
               call_end="}", separator=", ", calls_end="]", system_prompt=MISTRAL_PROMPT,
               call_id_style="mistral9", result_begin="[TOOL_RESULTS]", result_end="[/TOOL_RESULTS]")
MISTRAL_V11 = _fmt("mistral_v11", call_begin="[TOOL_CALLS]", args_begin="[ARGS]", call_end="", separator="",
                   system_prompt=MISTRAL_V11_PROMPT, call_id_style="mistral9",
                   result_begin="[TOOL_RESULTS]", result_end="[/TOOL_RESULTS]")
DEEPSEEK_V3 = _fmt("deepseekv3", calls_begin="<｜tool▁calls▁begin｜>",
                   call_begin="<｜tool▁call▁begin｜>function<｜tool▁sep｜>", args_begin="\n```json\n",
                   call_end="\n```<｜tool▁call▁end｜>", separator="\n", calls_end="<｜tool▁calls▁end｜>",
                   system_prompt=DEEPSEEK_PROMPT, builtin="deepseek_r1",
                   result_begin="<｜tool▁output▁begin｜>", result_end="<｜tool▁output▁end｜>")
DEEPSEEK_V31 = _fmt("deepseekv31", calls_begin="<｜tool▁calls▁begin｜>", call_begin="<｜tool▁call▁begin｜>",
                    args_begin="<｜tool▁sep｜>", call_end="<｜tool▁call▁end｜>", separator="",
                    calls_end="<｜tool▁calls▁end｜>", system_prompt=DEEPSEEK_PROMPT, builtin="deepseek_v3_1",
                    result_begin="<｜tool▁output▁begin｜>", result_end="<｜tool▁output▁end｜>")

# SGLang's --tool-call-parser names. qwen25 / qwen write Hermes' <tool_call> JSON; mistral is
# v3's [TOOL_CALLS] JSON list and mistral_v11 the [TOOL_CALLS]NAME[ARGS]{...} form of v11+
# templates (SGLang reads both under "mistral"; the grammar must write one, so we name it).
TOOL_CALL_PARSERS = {
    "hermes": HERMES, "qwen25": HERMES, "qwen": HERMES, "qwen3_coder": QWEN3_CODER,
    "llama3": LLAMA3, "pythonic": PYTHONIC, "mistral": MISTRAL, "mistral_v11": MISTRAL_V11,
    "deepseekv3": DEEPSEEK_V3, "deepseekv31": DEEPSEEK_V31,
}


def get_format(parser: Optional[str]) -> ToolCallFormat:
    """The format for ``--tool-call-parser`` (None: the default, Hermes)."""
    if parser is None:
        return HERMES
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool call parser {parser!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[parser]
