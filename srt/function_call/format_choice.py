"""Which tool-call format a server speaks: ``--tool-call-parser`` when given, else the one
its chat template writes (detect.py), else Hermes; logged once, with the reason."""
from __future__ import annotations

import functools
import logging
from typing import Optional

from srt.function_call.detect import detect_tool_call_parser
from srt.function_call.formats import ToolCallFormat, get_format

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=16)  # one decision per (flag, template): the log says it once
def choose_format(parser: Optional[str], chat_template: Optional[str]) -> tuple[ToolCallFormat, str]:
    """(the format, why it was chosen)."""
    if parser is not None:
        return get_format(parser), f"--tool-call-parser {parser}"
    detected, why = detect_tool_call_parser(chat_template)
    fmt = get_format(detected)
    reason = f"the chat template: {why}" if detected else f"the default ({why})"
    logger.info("tool-call format %s, chosen by %s", fmt.name, reason)
    return fmt, reason


def format_for(server_args, tokenizer) -> ToolCallFormat:
    template = getattr(tokenizer, "chat_template", None)
    return choose_format(getattr(server_args, "tool_call_parser", None),
                         template if isinstance(template, str) else None)[0]
