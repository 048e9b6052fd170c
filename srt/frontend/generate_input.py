"""The native request shape (``GenerateReqInput``) and its validation + tokenization into
the ``TokenizedGenerateReq`` the scheduler receives. All user errors are ValueErrors
(HTTP 400) raised here, before anything is sent."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from constrained.grammar_config import DISABLED_MESSAGE
from sampling.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from srt.frontend.sglang_fields import REQUEST_FIELDS, SAMPLING_FIELDS, take_neutral, take_sampling_seed
from srt.transport.io_struct import LogprobRequest, SchedulerInfo, TokenizedGenerateReq


@dataclass
class GenerateReqInput:
    """One generation request (SGLang's native /generate body). Give text or input_ids.

    ``sampling_params["max_new_tokens"] = None`` means "as many as the context allows"
    (the OpenAI default); leaving it out means SamplingParams' default (128, SGLang).
    ``custom_logit_processor`` is top-level as in SGLang (``CustomLogitProcessor.to_str()``);
    its per-request ``custom_params`` go in ``sampling_params``.
    """

    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: Optional[dict] = None
    stream: bool = False
    rid: Optional[str] = None
    custom_logit_processor: Optional[str] = None
    # Thinking models (--reasoning-parser): the constraint starts after the think end.
    require_reasoning: bool = False
    # Logprobs (SGLang's names): of the output tokens, their top alternatives, and the
    # prompt's from logprob_start_len on (-1: none of the prompt's).
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    @classmethod
    def from_dict(cls, d: Any) -> "GenerateReqInput":
        """Parse one prompt's JSON body (a batch is split first: generate_batch.py);
        unknown keys and wrong types raise ValueError. SGLang's fields that ask for nothing
        here (sglang_fields.py) are dropped; one that asks for a missing feature is refused."""
        if not isinstance(d, Mapping):
            raise ValueError("The request body must be a JSON object.")
        d = take_neutral(d, REQUEST_FIELDS, "")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Unknown field(s) in request: {', '.join(unknown)}")
        checks = {"text": str, "sampling_params": Mapping, "stream": bool, "rid": str,
                  "custom_logit_processor": str, "require_reasoning": bool,
                  "return_logprob": bool, "return_text_in_logprobs": bool}
        for name, typ in checks.items():
            if d.get(name) is not None and not isinstance(d[name], typ):
                if isinstance(d[name], list):
                    raise ValueError(f"{name} is a list, but the request has one prompt: lists of "
                                     "one value per prompt are for a batch (text or input_ids as a list).")
                raise ValueError(f"{name} must be a {typ.__name__.lower()}, got {d[name]!r}")
        for name in ("logprob_start_len", "top_logprobs_num"):
            if d.get(name) is not None and not _is_int(d[name]):
                raise ValueError(f"{name} must be an integer, got {d[name]!r}")
        ids = d.get("input_ids")
        if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
            raise ValueError("input_ids must be a list of integers (a batch: a list of such lists).")
        if d.get("sampling_params") is not None:
            sp = take_neutral(d["sampling_params"], SAMPLING_FIELDS, "sampling_params.")
            d = {**d, "sampling_params": take_sampling_seed(sp)}
        return cls(**{k: v for k, v in d.items() if v is not None})


def prepare_request(obj: GenerateReqInput, tokenizer, info: SchedulerInfo, *,
                    enable_custom_logit_processor: bool = False,
                    grammar_backend: str = "xgrammar",
                    max_token_chars: Optional[int] = None,
                    reasoning_parser: Optional[str] = None) -> TokenizedGenerateReq:
    """Validate and tokenize; every user error is a ValueError raised here, before
    anything reaches the scheduler. ``enable_custom_logit_processor`` and
    ``grammar_backend`` are server flags (frontend policies, passed here rather than
    carried in SchedulerInfo). Grammars compile on the scheduler ranks, which report
    compile errors as 400s; here only the spec's shape is checked."""
    if (obj.text is None) == (obj.input_ids is None):
        raise ValueError("Exactly one of text or input_ids must be given.")
    sp = _merged_sampling_params(obj)
    # Noted before parsing: SamplingParams reads a null max_new_tokens as its default.
    fill_context = "max_new_tokens" in sp and sp["max_new_tokens"] is None
    params = SamplingParams.from_dict(sp)
    params.verify(info.vocab_size)
    _check_server_policies(params, info.vocab_size, enable_custom_logit_processor,
                           grammar_backend)
    check_thinking_budget(params.thinking_budget, reasoning_parser, grammar_backend)
    input_ids = _prompt_token_ids(obj, tokenizer, info, max_token_chars)
    n = len(input_ids)
    _check_prompt_fits(n, info)
    params = _with_output_budget(params, n, info, fill_context)
    rid = obj.rid if obj.rid is not None else uuid.uuid4().hex
    return TokenizedGenerateReq(rid, tuple(input_ids), params, bool(obj.stream),
                                require_reasoning=bool(obj.require_reasoning),
                                logprobs=logprob_request(obj, n))


def _merged_sampling_params(obj: GenerateReqInput) -> dict:
    """The request's sampling_params with the top-level custom_logit_processor (SGLang's
    place for it) moved in; giving it in both places is fine only if they agree."""
    sp = dict(obj.sampling_params or {})
    if obj.custom_logit_processor is not None:
        if sp.get("custom_logit_processor") not in (None, obj.custom_logit_processor):
            raise ValueError("custom_logit_processor is given twice (top level and in "
                             "sampling_params) with different values.")
        sp["custom_logit_processor"] = obj.custom_logit_processor
    return sp


def check_thinking_budget(budget: Optional[int], reasoning_parser: Optional[str],
                          grammar_backend: str) -> None:
    """A thinking_budget needs a thinking model's format and the grammar machinery that
    enforces it (docs/reasoning.md): never ignored silently."""
    if budget is None:
        return
    if not reasoning_parser:
        raise ValueError("thinking_budget needs a server started with --reasoning-parser (the "
                         "format that says where thinking ends); this one has none.")
    if grammar_backend == "none":
        raise ValueError("thinking_budget is enforced by the grammar machinery, which this server "
                         "runs without (--grammar-backend none).")


def _check_server_policies(params: SamplingParams, vocab: int,
                           enable_custom_logit_processor: bool, grammar_backend: str) -> None:
    """Reject what this server was started not to serve (constraints, custom processors)."""
    if params.constraint is not None and grammar_backend == "none":
        # Never ignore a constraint silently: the output would not follow it.
        raise ValueError(DISABLED_MESSAGE.format(kind=params.constraint[0]))
    if params.custom_logit_processor is not None:
        if not enable_custom_logit_processor:
            raise ValueError("This server does not accept custom logit processors: start it "
                             "with --enable-custom-logit-processor to allow custom_logit_processor.")
        # Imported here: it needs torch, which the frontend loads only on servers with
        # --enable-custom-logit-processor (serve imports it at start there).
        from sampling.custom_logit_processor import validate_custom_logit_processor

        validate_custom_logit_processor(params.custom_logit_processor, params.custom_params, vocab)


def _prompt_token_ids(obj: GenerateReqInput, tokenizer, info: SchedulerInfo,
                      max_token_chars: Optional[int]) -> list[int]:
    """The prompt's token ids: the text tokenized (once it surely fits the context), or the
    given ids checked against the vocabulary."""
    if obj.text == "":
        raise ValueError("The input is empty: the prompt must have at least one token.")
    if obj.text is not None and max_token_chars is not None:
        check_fits_context(len(obj.text), info.context_len, max_token_chars)
    if obj.text is not None:
        return list(tokenizer.encode(obj.text))
    input_ids = list(obj.input_ids)
    bad = [t for t in input_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ValueError(f"input_ids must be in [0, {info.vocab_size}), got {bad[0]}.")
    return input_ids


def _check_prompt_fits(n: int, info: SchedulerInfo) -> None:
    """A prompt of ``n`` tokens must be non-empty and leave room in the context and in the
    KV cache pool (the scheduler could never run it otherwise)."""
    ctx, pool = info.context_len, info.max_total_num_tokens
    if n == 0:
        raise ValueError("The input is empty: the prompt must have at least one token.")
    if n >= ctx:
        raise ValueError(
            f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    if n >= pool:
        raise ValueError(
            f"The input ({n} tokens) is longer than the KV cache pool ({pool} tokens); "
            "start the server with a larger --max-total-tokens."
        )


def _with_output_budget(params: SamplingParams, n: int, info: SchedulerInfo,
                        fill_context: bool) -> SamplingParams:
    """``params`` with max_new_tokens settled for an ``n``-token prompt: filled up to the
    context when it was null, else checked to fit it."""
    ctx, pool = info.context_len, info.max_total_num_tokens
    if fill_context:
        # OpenAI semantics: no max_tokens = up to the context (and what the pool holds).
        return dataclasses.replace(
            params, max_new_tokens=max(min(ctx, pool) - n, params.min_new_tokens)
        )
    if n + params.max_new_tokens > ctx:
        # SGLang's message (it errors rather than clipping silently).
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {n + params.max_new_tokens} tokens: {n} "
            f"tokens from the input messages and {params.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    return params


def logprob_request(obj: GenerateReqInput, prompt_len: int) -> Optional[LogprobRequest]:
    """The request's logprob fields, checked; None when no logprobs are asked for. Without
    return_logprob, logprob_start_len and return_text_in_logprobs are ignored as SGLang
    ignores them (its clients send them with every request); a positive
    top_logprobs_num asks for logprobs and is refused."""
    if not 0 <= obj.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {obj.top_logprobs_num}.")
    if not obj.return_logprob:
        if obj.top_logprobs_num:
            raise ValueError(f"top_logprobs_num ({obj.top_logprobs_num}) asks for logprobs: "
                             "send return_logprob: true with it.")
        return None
    if not -1 <= obj.logprob_start_len < prompt_len:
        raise ValueError(f"logprob_start_len must be -1 (output tokens only) or a prompt position "
                         f"in [0, {prompt_len - 1}] (the prompt has {prompt_len} tokens), "
                         f"got {obj.logprob_start_len}.")
    return LogprobRequest(obj.top_logprobs_num, obj.logprob_start_len, obj.return_text_in_logprobs)


def check_fits_context(num_chars: int, context_len: int, max_token_chars: int) -> None:
    """Reject, before tokenizing it, a text too long for the context at any tokenization
    (so a huge prompt costs nothing: its tokenization could take seconds)."""
    if num_chars > context_len * max_token_chars:
        raise ValueError(
            f"The input ({num_chars} characters) cannot fit the model's context length "
            f"({context_len} tokens): no token of this tokenizer is longer than "
            f"{max_token_chars} characters.")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
