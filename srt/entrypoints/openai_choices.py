"""What the chat and completions handlers share about choices: usage, finish reasons,
structured-output fields, and a streamed request's outputs per choice."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from srt.entrypoints.http_common import abort_event, is_error_abort
from srt.entrypoints.openai_responses import PromptTokensDetails, UsageInfo
from srt.frontend.samples import combine_usage
from srt.frontend.tokenizer_manager import TokenizerManager


def _usage(meta: dict) -> UsageInfo:  # one output's meta_info, or combine_usage's counts
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=meta.get("cached_tokens", 0)))


async def choice_outputs(tm: TokenizerManager, req) -> AsyncIterator[tuple[int, Any]]:
    """A streamed request's outputs as (choice index, output); an error abort comes as
    (index, its SSE error event) and ends it (an administrator's abort is an ordinary last
    output, finish reason ``abort``). Closing this aborts the request."""
    async with contextlib.aclosing(tm.generate_request(req)) as outputs:
        async for out in outputs:
            fr = out["meta_info"]["finish_reason"]
            if is_error_abort(fr):
                yield out.get("index", 0), abort_event(fr)
                return
            yield out.get("index", 0), out


def usage_of(outs: list[dict]) -> UsageInfo:
    """Usage of a request's outputs (n > 1: the prompt once, every sample's completion)."""
    return _usage(combine_usage(outs))


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far."""

    tools: Any  # its tool-call stream parser
    sent: str = ""
    logprobs_sent: int = 0
    reasoning: Any = None  # its ReasoningParser (srt/frontend/reasoning_parser.py)

    def deltas(self, split, thought: str, answer: str) -> list[dict]:
        """DeltaMessage fields for new text: the thinking first, then the answer's content
        and tool-call deltas (the tool-call parser sees the answer only)."""
        return split.delta(thought) + (list(self.tools.deltas(answer)) if answer else [])


def _finish(fr: Optional[dict]) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, SGLang matched_stop)."""
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def structured_output(meta: dict) -> dict:
    """A choice's structured-output fields (docs/constrained.md): ``grammar`` (what served its json_schema)
    and ``schema_violation`` (finish_reason "schema_violation": the validator's message,
    keyword and paths). Empty until the request finishes."""
    fr, out = meta.get("finish_reason"), {}
    if fr is not None and meta.get("grammar") is not None:
        out["grammar"] = meta["grammar"]
    if fr is not None and fr["type"] == "schema_violation":
        # "part": the structural-tag part (a tool call's: its function name) that broke its schema
        out["schema_violation"] = {k: fr[k] for k in ("message", "keyword", "path", "schema_path", "part")
                                   if k in fr}
    return out
