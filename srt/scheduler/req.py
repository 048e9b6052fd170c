"""A request's state inside the scheduler (identical on every rank of a TP group)."""
from __future__ import annotations

import time
from typing import Optional

from sampling.sampling_params import SamplingParams
from srt.speculative.spec_state import SpecState
from srt.transport.io_struct import FinishReason, LogprobRequest


class Req:
    def __init__(self, rid: str, input_ids: tuple[int, ...], params: SamplingParams,
                 stream: bool, eos_token_ids: frozenset[int], require_reasoning: bool = False,
                 logprobs: Optional[LogprobRequest] = None, prefix_group: Optional[str] = None):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = params
        self.stream = stream
        self.output_ids: list[int] = []
        self.finished_reason: Optional[FinishReason] = None
        # KV state: row in req_to_token and how many tokens of fill_ids are cached.
        self.req_pool_idx: Optional[int] = None
        self.kv_committed_len = 0
        # Radix cache: the cached prefix taken at admission (its slots and tree node, locked
        # while the request holds them) and how many of those tokens the tree owns.
        self.prefix_slots = None
        self.last_node = None
        self.prefix_len = 0
        self.cached_tokens: Optional[int] = None  # prompt tokens served from the cache
        # Chunked prefill: tokens this step prefills when that is less than the rest of
        # the prompt (set by the PrefillAdder for one step; None: prefill to the end).
        self.extend_limit: Optional[int] = None
        self.sent_len = 0  # output tokens already sent to the frontend
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids)
        # Wall-clock times: read only on the entry rank (timeouts are decided there).
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: Optional[float] = None
        # Constrained generation (constrained/grammar_manager.py).
        self.require_reasoning = require_reasoning
        self.grammar = None  # BaseGrammarObject once compiled and agreed on
        self.grammar_report = None  # GrammarReport of that grammar, for the frontend
        self.grammar_key: Optional[tuple[str, str]] = None
        self.grammar_future = None  # Future while waiting in the grammar queue
        self.grammar_wait_ct = 0  # scheduler polls spent waiting (identical on every rank)
        self.fast_forward_tokens = 0  # output tokens the grammar forced (no decode step each)
        # Speculative decoding (srt/speculative): drafts for the next step, acceptance.
        self.spec: Optional[SpecState] = None
        # Logprobs (entry rank only fills them): one entry per output token, and the
        # prompt's from logprobs.start_len on, computed while it is prefilled.
        self.logprobs = logprobs
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self.input_token_logprobs: list[Optional[float]] = []
        self.input_top_logprobs: list[tuple[tuple[int, float], ...]] = []
        self.input_logprobs_done = logprobs is None or logprobs.start_len < 0
        self.input_logprobs_sent = self.input_logprobs_done
        # Prompt logprobs and the radix cache (srt/scheduler/prompt_logprob_cache.py), on
        # every rank: positions [.., scored_until) have theirs (computed or cached);
        # those before logprobs_stored_until are in the cache's pool; a match's find.
        self.scored_until = 0
        self.logprobs_stored_until = 0
        self.cached_prompt_logprobs = None
        self.prefix_group = prefix_group  # samples of one prompt (n > 1)
        # Hybrid models with the radix cache: positions whose recurrent state the next prefill
        # keeps as a checkpoint, and (position, checkpoint slot) kept but not yet in the tree.
        self.state_marks: list[int] = []
        self.pending_checkpoints: list[tuple[int, int]] = []

    @property
    def return_logprob(self) -> bool:
        return self.logprobs is not None

    @property
    def logprob_start(self) -> int:
        """First prompt position whose logprob is returned (clamped to the prompt)."""
        return min(self.logprobs.start_len, len(self.origin_input_ids) - 1)

    @property
    def uncomputed_tokens(self) -> int:
        """Tokens without KV yet, which the next decode step feeds: the last output token,
        plus any fast-forwarded after it."""
        return self.seqlen - self.kv_committed_len

    @property
    def draft_ids(self) -> list[int]:
        """Drafted tokens the next decode step verifies (rows after the uncomputed ones;
        never in ``output_ids`` until accepted)."""
        return self.spec.draft if self.spec is not None else []

    @property
    def decode_rows(self) -> int:
        """Rows the next decode step feeds for this request (KV slots it takes)."""
        return self.uncomputed_tokens + len(self.draft_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def check_finished(self, tokenizer) -> None:
        """Decide, after a token was appended, whether the request is done. A stop that
        coincides with the last allowed token reports "stop" (as OpenAI and vLLM do)."""
        if self.finished:
            return
        params = self.sampling_params
        n = len(self.output_ids)
        if self.grammar is not None and self.grammar.is_terminated():
            # The grammar reached its end: xgrammar after taking EOS, llguidance already when
            # nothing but EOS could follow. Only a stop token is "matched" (hidden from text).
            last = self.output_ids[-1]
            self.finished_reason = FinishReason("stop", matched=last if last in self.stop_ids else None)
            return
        if n >= params.min_new_tokens:
            last = self.output_ids[-1]
            if last in self.stop_ids:
                self.finished_reason = FinishReason("stop", matched=last)
                return
            if params.stop and tokenizer is not None:
                # Each token is at least one character, so this tail covers any stop string.
                tail = tokenizer.decode(self.output_ids[-(params.max_stop_str_len + 1):])
                for s in params.stop:
                    if s in tail:
                        self.finished_reason = FinishReason("stop", matched=s)
                        return
        if n >= params.max_new_tokens:
            self.finished_reason = FinishReason("length", matched=params.max_new_tokens)
