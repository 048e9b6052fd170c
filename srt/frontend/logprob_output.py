"""A request's logprobs as the frontend collects them from the scheduler's messages, and
their SGLang-shaped ``meta_info`` fields: ``[logprob, token_id, text]`` per token
(``text`` is None unless ``return_text_in_logprobs``), and per position a list of such
entries for the top alternatives."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from srt.transport.io_struct import LogprobRequest, TokenLogprobs


@dataclass
class LogprobAccumulator:
    request: LogprobRequest
    prompt_ids: tuple[int, ...]
    output: list[Optional[float]] = field(default_factory=list)
    output_top: list[tuple] = field(default_factory=list)
    prompt: Optional[TokenLogprobs] = None

    def add(self, output: Optional[TokenLogprobs], prompt: Optional[TokenLogprobs]) -> None:
        if output is not None:
            self.output.extend(output.token_logprobs)
            self.output_top.extend(output.top)
        if prompt is not None:
            self.prompt = prompt

    def meta_info(self, output_ids: list[int], tokenizer) -> dict[str, Any]:
        text = (lambda t: tokenizer.decode([t])) if self.request.with_text else (lambda t: None)
        out: dict[str, Any] = {
            "output_token_logprobs": [[lp, t, text(t)] for lp, t in zip(self.output, output_ids)],
            "output_top_logprobs": [_top(top, text) for top in self.output_top[:len(output_ids)]],
        }
        if self.request.start_len >= 0:
            lps = self.prompt.token_logprobs if self.prompt is not None else ()
            tops = self.prompt.top if self.prompt is not None else ()
            ids = self.prompt_ids[len(self.prompt_ids) - len(lps):]
            out["input_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(lps, ids)]
            out["input_top_logprobs"] = [_top(top, text) if lp is not None else None
                                         for lp, top in zip(lps, tops)]
        return out


def _top(top, text) -> list:
    return [[lp, t, text(t)] for t, lp in top]
