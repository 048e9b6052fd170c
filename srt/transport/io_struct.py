"""Messages that cross the frontend <-> scheduler boundary over ZMQ, all frozen, and the
codec each socket decodes with (typed msgpack, ``wire.py``; never pickle)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from constrained.schema_coverage import GrammarReport
from sampling.sampling_params import SamplingParams
from srt.transport.wire import MessageCodec
from srt.metrics.messages import SchedulerMetrics  # --enable-metrics: entry rank -> frontend


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
class LogprobRequest:
    """What logprobs a request wants (SGLang's native fields). ``start_len`` >= 0 also asks
    for the prompt's logprobs from that position on; -1: output tokens only."""

    top_n: int = 0  # top alternatives per position (0: only the chosen token's)
    start_len: int = -1
    with_text: bool = False  # the frontend adds each token's text (return_text_in_logprobs)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of some consecutive tokens: each token's own (None where nothing precedes
    it: the prompt's first token) and, when asked, its top alternatives as (id, logprob)."""

    token_logprobs: tuple[Optional[float], ...] = ()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class TokenizedGenerateReq:
    rid: str
    input_ids: tuple[int, ...]
    sampling_params: SamplingParams
    stream: bool = False
    # Thinking models: the constraint starts after the think-end token (--reasoning-parser).
    require_reasoning: bool = False
    logprobs: Optional[LogprobRequest] = None  # None: no logprobs asked
    # Samples of one prompt (``n`` > 1) share this key: the scheduler prefills the prompt
    # once and the other samples take it from the radix cache.
    prefix_group: Optional[str] = None


ANSWERED_ABORT = 200  # an abort whose request is answered normally, with its partial output


@dataclass(frozen=True)
class AbortReq:
    """Abort one request. Also produced by the entry rank itself (timeouts), so every rank
    of a TP group handles the same aborts in the same iteration.

    ``status_code`` is the HTTP status the request's answer gets: 200 (``ANSWERED_ABORT``,
    an administrator's /abort_request) answers with the partial output and finish reason
    ``abort``, as SGLang does; 4xx / 5xx (grammar errors, timeouts, shutdown) answer with
    an error; 499 is a client that went away (nobody reads the answer)."""

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
    cached_tokens: tuple[int, ...] = ()  # prompt tokens served from the radix cache
    # Output tokens so far that grammar fast-forward appended without a decode step each.
    fast_forward_tokens: tuple[int, ...] = ()
    # Speculative decoding: decode steps each request took while speculation was on
    # (SGLang's spec_verify_ct); empty with speculation off.
    spec_verify_ct: tuple[int, ...] = ()
    # Requests that asked for logprobs: those of new_token_ids[i], and the prompt's (sent
    # once, with the first message after the prompt was prefilled); None where not asked.
    output_logprobs: tuple[Optional[TokenLogprobs], ...] = ()
    input_logprobs: tuple[Optional[TokenLogprobs], ...] = ()
    # Constrained requests, with their final message: what served the grammar (else None).
    grammar_reports: tuple[Optional[GrammarReport], ...] = ()


@dataclass(frozen=True)
class FlushCacheReq:
    """POST /flush_cache: empty the radix cache if nothing is running (every rank)."""

    rid: str


@dataclass(frozen=True)
class FlushCacheOut:
    rid: str
    success: bool
    message: str = ""


@dataclass(frozen=True)
class SchedulerInfo:
    """Sent once by each entry rank when it is ready to serve."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # Prompt logprobs kept with the radix cache: bytes per KV token (0: off), in the budget.
    prompt_logprob_cache_bytes_per_token: int = 0
    # Hybrid GDN models: the recurrent-state pool (one slot per running request), in the
    # memory budget; and what is switched off for the model (model_executor/hybrid_limits.py).
    linear_state_slots: int = 0
    linear_state_bytes_per_slot: int = 0
    model_limits: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankReady:
    """Every rank's start-up report to the launcher: ready (entry ranks add their
    SchedulerInfo and the address their request socket is bound to) or failed."""

    world_rank: int
    name: str  # "DP{d}_TP{t}"
    error: Optional[str] = None
    info: Optional[SchedulerInfo] = None
    input_addr: Optional[str] = None  # entry ranks: where the frontend sends this DP group's requests


@dataclass(frozen=True)
class PortArgs:
    """ZMQ endpoints. The frontend binds ``frontend_input`` and ``ready``; each entry rank
    binds its DP group's ``scheduler_inputs[d]`` and reports the address it got in
    RankReady. On one node these are IPC files in a private (0700) directory; across nodes
    they are CURVE-authenticated TCP endpoints on each node's cluster address, and a
    scheduler input is ``TCP_ANY_PORT``: a free port on the entry rank's own node."""

    frontend_input_ipc: str  # scheduler PUSH -> frontend PULL
    ready_ipc: str  # every rank PUSH RankReady -> launcher PULL
    scheduler_input_ipcs: tuple[str, ...]  # frontend PUSH -> entry rank of DP group d

    @property
    def scheduler_input_ipc(self) -> str:
        """DP group 0's request endpoint (the only one at --dp-size 1)."""
        return self.scheduler_input_ipcs[0]

    @property
    def is_tcp(self) -> bool:
        return self.ready_ipc.startswith("tcp://")

    @property
    def local_dir(self) -> Optional[str]:
        """The private directory of the IPC files (and torch's store), None over TCP."""
        return None if self.is_tcp else os.path.dirname(self.ready_ipc[len("ipc://"):])

    def remove_local_dir(self) -> None:
        """Remove the IPC directory: its creator does, once the server has stopped (each
        start made a new one, and none was ever removed)."""
        if self.local_dir is not None:
            shutil.rmtree(self.local_dir, ignore_errors=True)

    @classmethod
    def new(cls, dp_size: int = 1, tcp_host: Optional[str] = None) -> "PortArgs":
        """IPC files in a fresh private directory (one machine), or TCP ports on
        ``tcp_host`` (node 0's cluster address, where the other nodes reach it)."""
        if tcp_host is not None:
            return cls(f"tcp://{tcp_host}:{free_port(tcp_host)}", f"tcp://{tcp_host}:{free_port(tcp_host)}",
                       (TCP_ANY_PORT,) * dp_size)
        import tempfile

        d = tempfile.mkdtemp(prefix="gramsync-ipc-")  # mode 0700, checked again at bind
        return cls(f"ipc://{d}/frontend_input", f"ipc://{d}/ready",
                   tuple(f"ipc://{d}/scheduler_input_dp{i}" for i in range(dp_size)))


TCP_ANY_PORT = "tcp://<this node>:0"


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# What each socket accepts; anything else is dropped and counted (wire.py).
SCHEDULER_INPUT_CODEC = MessageCodec(TokenizedGenerateReq, AbortReq, FlushCacheReq)
FRONTEND_INPUT_CODEC = MessageCodec(BatchTokenOut, FlushCacheOut, SchedulerMetrics)
READY_CODEC = MessageCodec(RankReady)
