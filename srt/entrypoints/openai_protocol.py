"""OpenAI-compatible request shapes (pydantic v2) and their mapping to ours; the response
shapes are in openai_responses.py.

Mapping (``to_sampling_params``): max_tokens / max_completion_tokens -> max_new_tokens,
min_tokens -> min_new_tokens, stop, seed, temperature, top_p, frequency_penalty,
presence_penalty and logit_bias (token-id string keys) keep their names; SGLang's extras
top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens, regex,
ebnf, choice (and json_schema for completions) and custom_params pass through, and
custom_logit_processor goes to the native request's top level. ``response_format``
json_schema / json_object / structural_tag become the json_schema / structural_tag
constraint (json_object = the schema ``{"type": "object"}``, as in SGLang). vLLM's
``structured_outputs`` / ``guided_*`` fields: vllm_dialect.py, which also resolves all of
them into one constraint (two fields giving one: a 400 naming both). Value ranges are checked
once, by SamplingParams, so both APIs return the same 400 messages.

Unknown-field policy: requests are ``extra="forbid"``, so a misspelt or unknown field is a
400 naming it. Common OpenAI fields we do not implement are declared explicitly and
 - ignored when they cannot change the generated text (``user``, ``metadata``, ``store``,
   ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
   ``stream_options.include_obfuscation``);
 - accepted at their neutral value and rejected with "<field> is not supported" otherwise
   (``suffix``, ``best_of``, ...). We never silently
   ignore something that would change the output.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from constrained.schema_coverage import with_strict
from sampling.sampling_params import MAX_TOP_LOGPROBS
from srt.entrypoints.vllm_dialect import VllmDialectFields, constraint_sources, request_constraint
from srt.function_call.tools import check_tool_choice, check_tools
from srt.entrypoints.openai_responses import ErrorDetail, ErrorResponse
from srt.frontend.generate_input import GenerateReqInput
from srt.frontend.reasoning_parser import request_reasons

# field -> predicate telling that its value is neutral (behaves as if absent).
_NEUTRAL = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "functions": lambda v: v is None,  # OpenAI's deprecated form of tools
    "function_call": lambda v: v is None,
}


# Request fields passed to SamplingParams under the same name when set.
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
              "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
              "custom_params")  # constraints: vllm_dialect.request_constraint
MAX_BATCHED_PROMPTS = 1024  # prompts in one /v1/completions request (each is a request inside)
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # ignored: we add no padding field


class _SamplingRequest(VllmDialectFields):
    """Fields shared by chat and text completions (vLLM's constraint fields: the base)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None  # any name is accepted (SGLang); responses echo it
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    # SGLang extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: Optional[float] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    choice: Optional[list[str]] = None
    response_format: Optional[dict[str, Any]] = None
    custom_logit_processor: Optional[str] = None  # CustomLogitProcessor.to_str()
    custom_params: Optional[dict[str, Any]] = None

    @field_validator("response_format")
    @classmethod
    def _known_response_format(cls, v: Optional[dict]) -> Optional[dict]:
        response_format_constraint(v)  # raises with the reason
        return v

    @model_validator(mode="after")
    def _one_constraint(self):  # both dialects, checked before any prompt work
        request_constraint(self, response_format_constraint(self.response_format))
        return self

    @model_validator(mode="after")
    def _reject_unsupported(self):
        for name, neutral in _NEUTRAL.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                raise ValueError(f"{name} is not supported by this server (got {getattr(self, name)!r})")
        return self

    def to_sampling_params(self, max_new_tokens: Optional[int]) -> dict:
        """Our SamplingParams dict; ``max_new_tokens=None`` means up to the context."""
        d: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos,
                             "skip_special_tokens": self.skip_special_tokens, "n": self.n}
        if self.min_tokens is not None:
            d["min_new_tokens"] = self.min_tokens
        for name in _SAME_NAME:
            if getattr(self, name, None) is not None:
                d[name] = getattr(self, name)
        d.update(request_constraint(self, response_format_constraint(self.response_format)))
        return d

    def generate_input(self, rid: str, **prompt) -> GenerateReqInput:
        """The native request (``prompt``: text= or input_ids=) this request maps to."""
        return GenerateReqInput(**prompt, sampling_params=self.sampling_params(), stream=self.stream,
                                rid=rid, custom_logit_processor=self.custom_logit_processor,
                                **self.logprob_fields())

    def logprob_fields(self) -> dict:
        """The native logprob fields this request asks for."""
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, ...) pass through to the chat template like SGLang/vLLM.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None

    def for_template(self) -> dict:
        """Plain-string content (templates expect str); only text parts are supported."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"Only text content parts are supported, got {part.get('type')!r}")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        d.setdefault("content", "")
        return d


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false}
    # --reasoning-parser (docs/reasoning.md): the thinking in reasoning_content (SGLang's
    # switch; false: left in content), and a cap on its tokens (vLLM's / SGLang's name).
    separate_reasoning: bool = True
    thinking_budget: Optional[StrictInt] = Field(default=None, ge=0)
    # SGLang / vLLM: the reply continues the last (assistant) message instead of starting a
    # new one; add_generation_prompt (vLLM) says whether a new one is opened.
    continue_final_message: bool = False
    add_generation_prompt: Optional[bool] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # ignored: the prefix cache needs no hint
    safety_identifier: Optional[str] = None  # ignored, like user
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None

    @field_validator("tools")
    @classmethod
    def _valid_tools(cls, v):
        return check_tools(v)  # srt/function_call/tools.py

    @field_validator("tool_choice")
    @classmethod
    def _valid_tool_choice(cls, v, info):
        return check_tool_choice(v, info.data["tools"]) if "tools" in info.data else v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_kwargs(cls, v):
        bad = sorted(set(v or {}) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}: only the chat "
                             "template's own variables (e.g. enable_thinking) are allowed")
        return v

    @model_validator(mode="after")
    def _continue_rules(self):
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                             "the reply either continues the last message or starts a new one.")
        if self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's "
                             f"(the one to continue), got role {self.messages[-1].role!r}.")
        if self.tools or constraint_sources(self, response_format_constraint(self.response_format)):
            raise ValueError("continue_final_message cannot be combined with tools or a constraint "
                             "(response_format, regex, ...): the constraint would cover only the "
                             "continuation, not the whole message.")
        return self

    def template_flags(self) -> dict:
        """apply_chat_template's add_generation_prompt / continue_final_message."""
        if self.continue_final_message:
            return {"add_generation_prompt": False, "continue_final_message": True}
        return {"add_generation_prompt": self.add_generation_prompt is not False}

    def requires_reasoning(self, reasoning_parser: Optional[str]) -> bool:
        """Does the model think before answering (so the constraint starts later)? See
        reasoning_parser.request_reasons: deepseek-r1 always; the others unless
        ``chat_template_kwargs.enable_thinking`` is false."""
        return request_reasons(reasoning_parser, self.chat_template_kwargs)

    def sampling_params(self) -> dict:
        d = self.to_sampling_params(self._max_tokens())
        if self.thinking_budget is not None:
            d["thinking_budget"] = self.thinking_budget
        return d

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _at_least_one_token(self):
        if self._max_tokens() == 0:
            raise ValueError("max_tokens (or max_completion_tokens) must be at least 1: a chat "
                             "completion of 0 tokens is empty (to score a prompt, use "
                             "/v1/completions with echo: true and max_tokens: 0).")
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true.")
        return self

    def logprob_fields(self) -> dict:
        if not self.logprobs:
            return {}
        return {"return_logprob": True, "top_logprobs_num": self.top_logprobs or 0}


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    json_schema: Optional[Union[str, dict[str, Any]]] = None  # SGLang extra (completions only)

    @model_validator(mode="after")
    def _echo_rules(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo: true (it scores the prompt "
                             "and generates nothing); ask for at least 1 token otherwise.")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list: give a string, a list of token ids, or a "
                             "non-empty list of either.")
        count = len(self.prompts())
        if count > MAX_BATCHED_PROMPTS:
            raise ValueError(f"prompt is a batch of {count} prompts; at most {MAX_BATCHED_PROMPTS} "
                             "fit in one request: split it into several requests.")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts: a list of strings or of token-id lists is a batch (one
        choice per prompt, in order); anything else is one prompt."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def logprob_fields(self) -> dict:
        if self.logprobs is None:
            return {}
        # echo: the prompt's logprobs too, from its first token (which has none).
        return {"return_logprob": True, "top_logprobs_num": self.logprobs,
                "logprob_start_len": 0 if self.echo else -1}

    def sampling_params(self) -> dict:
        # Completions default to 16 tokens in OpenAI's API (chat defaults to the context).
        return self.to_sampling_params(self.max_tokens if self.max_tokens is not None else 16)


def response_format_constraint(rf: Optional[dict]) -> Optional[tuple[str, Any]]:
    """OpenAI ``response_format`` -> (constraint kind, spec), or None for plain text."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {', '.join(_RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "structural_tag":
        return "structural_tag", rf
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError('response_format of type json_schema needs "json_schema": '
                         '{"name": ..., "schema": {...}}')
    if not isinstance(spec["schema"], (dict, bool)):
        raise ValueError("response_format.json_schema.schema must be a JSON object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
    return "json_schema", with_strict(spec["schema"], bool(strict))


_EXTRA_PHRASES = {499: "Client Closed Request"}
# apply_chat_template's own parameters: a client must not set them (or supply a template).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenizer", "chat_template", "tokenize", "return_dict",
    "add_generation_prompt", "continue_final_message", "return_tensors", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "tools", "documents"})


def error_body(message: str, status_code: int = 400, param: Optional[str] = None) -> dict:
    """OpenAI/vLLM error shape: {"error": {"message", "type", "param", "code"}}."""
    try:
        phrase = HTTPStatus(status_code).phrase
    except ValueError:  # non-standard codes, e.g. 499 (client closed / aborted)
        phrase = _EXTRA_PHRASES.get(status_code, "Request Error")
    kind = "".join(w.capitalize() for w in phrase.split()) + "Error"
    kind = kind.replace("ErrorError", "Error")
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=status_code)).model_dump()


def validation_error_message(e: ValidationError) -> tuple[str, Optional[str]]:
    """One readable line naming each bad field, and the first field as ``param``."""
    parts, param = [], None
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        param = param or (loc or None)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of this API)"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts), param
