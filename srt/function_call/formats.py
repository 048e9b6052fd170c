"""Tool-call text formats (``--tool-call-parser``): how a call looks in the model's output,
and the system-prompt section that teaches it to templates without a tool format.

Every part of a format is a literal string, so the same few strings build the grammar
(grammar.py), render history (prompt.py) and drive the parsers (parser.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

# Hermes / Qwen2.5's system-prompt section, word for word (docs/tools.md): models
# trained on it call tools best when they see exactly this.
HERMES_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolCallFormat:
    """One call is ``begin + name + args_begin + <arguments JSON object> + end``; parallel
    calls are joined by ``separator``. ``begin`` starts with ``trigger``: in ``auto`` mode
    the model writes free text until it writes the trigger, then the grammar takes over."""

    name: str
    trigger: str
    begin: str
    args_begin: str
    end: str
    separator: str
    system_prompt: str  # str.format template with {tools}: one JSON tool per line
    result_begin: str  # a tool's result, as a user turn, for templates without tool roles
    result_end: str

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{self.begin}{name}{self.args_begin}{json.dumps(arguments, ensure_ascii=False)}{self.end}"

    def render_tools(self, tools: list[dict]) -> str:
        return self.system_prompt.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


HERMES = ToolCallFormat(
    name="hermes", trigger="<tool_call>", begin='<tool_call>\n{"name": "', args_begin='", "arguments": ',
    end="}\n</tool_call>", separator="\n", system_prompt=HERMES_SYSTEM_PROMPT,
    result_begin="<tool_response>\n", result_end="\n</tool_response>")

# SGLang's --tool-call-parser names; qwen25 / qwen use Hermes' <tool_call> JSON format.
TOOL_CALL_PARSERS = {"hermes": HERMES, "qwen25": HERMES, "qwen": HERMES}


def get_format(parser: Optional[str]) -> ToolCallFormat:
    """The format for ``--tool-call-parser`` (None: the default, Hermes)."""
    if parser is None:
        return HERMES
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool call parser {parser!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[parser]
