"""OpenAI's tool-call shapes in responses (``message.tool_calls``) and stream deltas."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field


def _absent(v) -> bool:
    return v is None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = Field(default=None, exclude_if=_absent)
    arguments: Optional[str] = Field(default=None, exclude_if=_absent)


class DeltaToolCall(BaseModel):
    """A call's first delta has id, type, function.name and arguments ""; later ones carry
    only index and an arguments fragment."""

    index: int
    id: Optional[str] = Field(default=None, exclude_if=_absent)
    type: Optional[Literal["function"]] = Field(default=None, exclude_if=_absent)
    function: DeltaFunctionCall
