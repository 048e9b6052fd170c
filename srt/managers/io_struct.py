"""Messages that cross the frontend <-> scheduler boundary (ZMQ, pickled). All frozen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. ``type`` is "stop", "length" or "abort" (SGLang's shape)."""

    type: str
    matched: Any = None  # the EOS/stop token id (int) or stop string (str) that matched
    message: Optional[str] = None  # for aborts: shown to the user
    status_code: int = 400  # for aborts: the HTTP status the frontend should use

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "abort":
            out["message"] = self.message
        else:
            out["matched"] = self.matched
        if self.type == "length":
            out["length"] = self.matched
            out.pop("matched")
        return out


@dataclass(frozen=True)
class TokenizedGenerateReq:
    rid: str
    input_ids: tuple[int, ...]
    sampling_params: SamplingParams
    stream: bool = False
    # Thinking models: the constraint starts after the think-end token (--reasoning-parser).
    require_reasoning: bool = False


@dataclass(frozen=True)
class AbortReq:
    """Abort one request. Also produced by the entry rank itself (timeouts), so every rank
    of a TP group handles the same aborts in the same iteration."""

    rid: str
    message: str = "Request aborted by the client."
    status_code: int = 499


@dataclass(frozen=True)
class BatchTokenOut:
    """One scheduler step's output for some requests.

    ``new_token_ids[i]`` are the tokens generated for ``rids[i]`` since the previous
    message about it (stream requests get one message per step; others only at finish).
    """

    rids: tuple[str, ...]
    new_token_ids: tuple[tuple[int, ...], ...]
    finished_reasons: tuple[Optional[FinishReason], ...]
    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerInfo:
    """Sent once by each entry rank when it is ready to serve."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PortArgs:
    """ZMQ endpoints between the frontend and the entry rank(s)."""

    scheduler_input_ipc: str  # frontend PUSH -> scheduler PULL
    frontend_input_ipc: str  # scheduler PUSH -> frontend PULL

    @classmethod
    def new(cls) -> "PortArgs":
        import tempfile

        d = tempfile.mkdtemp(prefix="gramsync-ipc-")
        return cls(f"ipc://{d}/scheduler_input", f"ipc://{d}/frontend_input")
