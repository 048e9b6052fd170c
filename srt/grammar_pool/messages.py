"""What crosses the rank <-> pool service <-> worker boundaries: typed msgpack (wire.py),
never pickle. A compiled grammar travels as a raw frame after its ``CompileResult``:
xgrammar's serialised form of a large grammar runs to hundreds of MB."""
from __future__ import annotations

from dataclasses import dataclass

from srt.transport.wire import MessageCodec


@dataclass(frozen=True)
class CompileTask:
    """A rank wants ``(kind, spec)`` compiled (rank -> service -> worker)."""

    kind: str
    spec: str


@dataclass(frozen=True)
class CompileRelease:
    """No request of this rank waits for ``(kind, spec)`` any more (rank -> service)."""

    kind: str
    spec: str


@dataclass(frozen=True)
class CompileResult:
    """A finished compile (worker -> service -> ranks); the grammar's bytes follow.
    ``fmt`` is "invalid" for a failure (the bytes are then the message)."""

    kind: str
    spec: str
    fmt: str
    compile_time: float  # wall seconds in the worker
    cpu_time: float  # CPU seconds the worker spent, export included
    dispatch_type: str  # GrammarStats.dispatch_type
    fallbacks: tuple[tuple[str, str], ...] = ()  # auto's (reason, outcome) counts, one each
    gaps: tuple[str, ...] = ()  # GrammarStats.gaps: what the grammar does not enforce


@dataclass(frozen=True)
class WorkerReady:
    """A worker built its backend and takes tasks (worker -> service)."""

    pid: int


TASK_CODEC = MessageCodec(CompileTask, CompileRelease)
RESULT_CODEC = MessageCodec(CompileResult, WorkerReady)
