"""OpenAI-compatible response shapes (pydantic v2): chat and text completions, their
stream chunks, usage, logprobs, models and errors."""
from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from srt.function_call.protocol import DeltaToolCall, ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the radix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    # --reasoning-parser: the thinking (SGLang's and vLLM's field); absent without any.
    reasoning_content: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: Optional[list[ToolCall]] = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None  # SGLang extension
    # Structured outputs (docs/constrained.md): what served the json_schema, and how its document broke it.
    grammar: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)
    schema_violation: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    content: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: Optional[list[DeltaToolCall]] = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None
    # Structured outputs (docs/constrained.md): what served the json_schema, and how its document broke it.
    grammar: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)
    schema_violation: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = Field(default=None, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Optional[Union[int, str]] = None
    # Structured outputs (docs/constrained.md): what served the json_schema, and how its document broke it.
    grammar: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)
    schema_violation: Optional[dict] = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "gramsync"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
