"""Logprob bookkeeping for the scheduler: which logits rows a prefill must return for
prompt logprobs, recording prompt and output logprobs on the requests, and the deltas the
entry rank sends.

Which rows a forward returns is decided on every rank alike (it changes the LM head's
collective shapes); the logprobs themselves are computed on the entry rank only, the one
that talks to the frontend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sampling.logprobs import chosen_and_top, model_chosen_and_top
from srt.transport.io_struct import TokenLogprobs
from srt.scheduler.req import Req


@dataclass
class PromptLogprobRows:
    """Extra logits rows of one prefill for one request's prompt logprobs: rows
    ``first .. first + len(targets) - 1`` of the extra logits predict ``targets``."""

    req: Req
    first: int
    targets: list[int]  # the prompt tokens those rows predict
    first_pos: int  # the prompt position of targets[0]
    leading_none: bool  # the prompt's first token is asked for: it has no logprob
    last_chunk: bool  # this prefill reaches the end of the prompt


def plan_prompt_logprobs(reqs: list[Req], extend_lens: list[int], prefix_lens: list[int]
                         ) -> tuple[Optional[list[int]], list[PromptLogprobRows]]:
    """(logit rows for the forward, or None for the default last row per sequence; the
    plan). The first ``len(reqs)`` rows stay each sequence's last, so sampling is
    unchanged; prompt-logprob rows follow."""
    pending = [i for i, r in enumerate(reqs) if not r.input_logprobs_done]
    if not pending:
        return None, []
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    rows = [s + n - 1 for s, n in zip(starts, extend_lens)]
    plan = []
    for i in pending:
        r, begin, n = reqs[i], prefix_lens[i], extend_lens[i]
        prompt_len, want = len(r.origin_input_ids), r.logprob_start
        # Position p's logits predict token p + 1; prompt tokens want .. prompt_len - 1.
        lo, hi = max(begin, want - 1, 0), min(begin + n, prompt_len - 1)
        plan.append(PromptLogprobRows(r, len(rows) - len(reqs), r.origin_input_ids[lo + 1:hi + 1],
                                      lo + 1, want == 0 and begin == 0, begin + n >= prompt_len))
        rows.extend(starts[i] + p - begin for p in range(lo, hi))
    return rows, plan


def record_prompt_logprobs(plan: list[PromptLogprobRows], extra_logits: Optional[torch.Tensor],
                           compute: bool) -> None:
    """Store each planned request's prompt logprobs (raw model distribution: penalties,
    grammars and temperature concern the output); ``compute`` is False off the entry rank,
    which only marks them done."""
    for p in plan:
        r = p.req
        if compute:
            if p.leading_none:
                r.input_token_logprobs.append(None)
                r.input_top_logprobs.append(())
            if p.targets:
                rows = extra_logits[p.first:p.first + len(p.targets)]
                ids = torch.tensor(p.targets, dtype=torch.int64)
                picked = model_chosen_and_top(rows, ids, [r.logprobs.top_n] * len(p.targets))
                for lp, top in picked:
                    r.input_token_logprobs.append(lp)
                    r.input_top_logprobs.append(top)
        if p.targets:
            r.scored_until = p.first_pos + len(p.targets)
        if p.last_chunk:
            r.input_logprobs_done = True


def logprob_rows(reqs: list[Req], compute: bool) -> list[int]:
    """Batch rows whose output logprobs are wanted (none off the entry rank)."""
    return [i for i, r in enumerate(reqs) if r.return_logprob] if compute else []


def record_output_logprobs(reqs: list[Req], rows: list[int], logprobs: Optional[torch.Tensor],
                           next_ids: torch.Tensor) -> None:
    """Append the sampled token's logprob (and top alternatives) to each row's request;
    called before the token itself is appended, so entries stay aligned with output_ids."""
    if not rows:
        return
    ids = next_ids[torch.tensor(rows, dtype=torch.int64, device=next_ids.device)]
    picked = chosen_and_top(logprobs, ids, [reqs[i].logprobs.top_n for i in rows])
    for i, (lp, top) in zip(rows, picked):
        reqs[i].output_token_logprobs.append(lp)
        reqs[i].output_top_logprobs.append(top)


def take_logprob_deltas(r: Req) -> tuple[Optional[TokenLogprobs], Optional[TokenLogprobs]]:
    """(output logprobs of the tokens not sent yet, the prompt's if ready and not sent);
    call before advancing ``r.sent_len``."""
    if not r.return_logprob:
        return None, None
    end = len(r.output_ids)  # a row aborted this step got a logprob but no token
    out = TokenLogprobs(tuple(r.output_token_logprobs[r.sent_len:end]),
                        tuple(r.output_top_logprobs[r.sent_len:end]))
    prompt = None
    if r.input_logprobs_done and not r.input_logprobs_sent:
        prompt = TokenLogprobs(tuple(r.input_token_logprobs), tuple(r.input_top_logprobs))
        r.input_logprobs_sent = True
    return out, prompt
