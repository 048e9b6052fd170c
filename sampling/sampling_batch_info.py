"""``SamplingBatchInfo``: the running batch's sampling state, kept in step with the batch.

Built once when requests are prefilled (``from_reqs``), then ``filter_batch`` drops rows of
finished / aborted / retracted requests and ``merge_batch`` appends newly prefilled ones,
so per-request tensors and penalizer state are never rebuilt from scratch.

``apply_logits_bias`` runs, in exactly this order: penalties (``penaltylib``), custom logit
processors, the grammar vocab mask, then the logit bias. Neither a processor nor a bias can
lift a masked token: the mask overwrites whatever a processor wrote with -inf, and the bias,
finite by validation, adds to -inf (-inf + b = -inf). Penalties act on the model's logits,
not on biased ones.
"""
from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from constrained.bitmask_ops import apply_token_bitmask_inplace
from sampling.penaltylib import BatchedPenalizerOrchestrator
from sampling.penaltylib.base import PenalizedRequest


DEAD_END_MESSAGE = ("The constraint cannot be completed: after the output so far its grammar "
                    "allows no token (for example a schema whose required property only refers "
                    "to itself).")


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size where disabled
    min_ps: torch.Tensor  # [B] float32
    greedy_mask: torch.Tensor  # [B] bool
    seeds: list[Optional[int]]
    positions: list[int]  # output position each row samples next (keys seeded noise)
    logit_bias: list[tuple[tuple[int, float], ...]]
    custom_processors: list[Optional[str]]
    custom_params: list[Optional[dict]]
    penalizer_orchestrator: BatchedPenalizerOrchestrator
    vocab_size: int
    device: torch.device
    generator: torch.Generator  # unseeded rows; seeded identically on every rank
    grammars: list[Optional[Any]] = field(default_factory=list)  # BaseGrammarObject or None
    vocab_mask: Optional[torch.Tensor] = None  # int32 [B, ceil(V/32)], filled per step
    # Host-side mask buffer reused across steps while the batch size stays the same.
    _mask_buffer: Optional[torch.Tensor] = None
    mask_fill_seconds: float = 0.0  # this step's fill time on the critical path (waited for)
    mask_fill_work_seconds: float = 0.0  # this step's fill time, wherever it ran
    mask_apply_seconds: float = 0.0
    mask_checked_first: bool = False  # this step's greedy ids passed every grammar unmasked
    # A fill started ahead (start_vocab_mask_fill), running while the forward runs.
    _mask_future: Optional[Future] = None
    # Derived by _refresh after every change of rows.
    is_all_greedy: bool = True
    has_greedy: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    _bias_index: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # Rows to abort after this step, (row, message, HTTP status): a custom logit processor
    # raised (500), or the grammar allows no token at all (400). The scheduler aborts those
    # requests only (see take_failed_rows); their sampled token is never used.
    failed_rows: list[tuple[int, str, int]] = field(default_factory=list)

    @classmethod
    def from_reqs(cls, reqs: Sequence[PenalizedRequest], vocab_size: int, device,
                  generator: torch.Generator) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        dev = torch.device(device)
        info = cls(
            temperatures=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                      dtype=torch.float32, device=dev).unsqueeze(1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            top_ks=torch.tensor([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
                                 for p in params], dtype=torch.int64, device=dev),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=dev),
            seeds=[p.seed for p in params],
            positions=[len(r.output_ids) for r in reqs],
            logit_bias=[p.logit_bias for p in params],
            custom_processors=[p.custom_logit_processor for p in params],
            custom_params=[p.custom_params for p in params],
            penalizer_orchestrator=BatchedPenalizerOrchestrator.build(reqs, vocab_size, dev),
            vocab_size=vocab_size, device=dev, generator=generator,
            grammars=[getattr(r, "grammar", None) for r in reqs],
        )
        info._refresh()
        return info

    def __len__(self) -> int:
        return len(self.seeds)

    def _refresh(self) -> None:
        sampled = ~self.greedy_mask
        self.is_all_greedy = not bool(sampled.any())
        self.has_greedy = bool(self.greedy_mask.any())
        self.need_top_k = bool(((self.top_ks < self.vocab_size) & sampled).any())
        self.need_top_p = bool(((self.top_ps < 1.0) & sampled).any())
        self.need_min_p = bool(((self.min_ps > 0.0) & sampled).any())
        self._bias_index = None

    def filtered_rows_mask(self) -> torch.Tensor:
        """bool [B]: sampled rows that need top-k, top-p or min-p filtering."""
        return ~self.greedy_mask & ((self.top_ks < self.vocab_size) | (self.top_ps < 1.0)
                                    | (self.min_ps > 0.0))

    # ---- keeping in step with the running batch ------------------------------------------
    def filter_batch(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (indices into the current batch, in their new order)."""
        idx = torch.tensor(list(keep), dtype=torch.int64, device=self.device)
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask"):
            setattr(self, name, getattr(self, name)[idx])
        for name in ("seeds", "positions", "logit_bias", "custom_processors", "custom_params",
                     "grammars"):
            old = getattr(self, name)
            setattr(self, name, [old[i] for i in keep])
        self.penalizer_orchestrator.filter(idx)
        self.vocab_mask = self._mask_buffer = None
        self._refresh()

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        """Append ``other``'s rows after ours."""
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name in ("seeds", "positions", "logit_bias", "custom_processors", "custom_params",
                     "grammars"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.penalizer_orchestrator.merge(other.penalizer_orchestrator)
        self.vocab_mask = self._mask_buffer = None
        self._refresh()

    def cumulate_output_tokens(self, output_ids: torch.Tensor) -> None:
        """Record the tokens this step sampled (int64 [B]): penalizer state and positions."""
        self.penalizer_orchestrator.cumulate_output_tokens(output_ids)
        self.positions = [p + 1 for p in self.positions]

    def cumulate_forced_tokens(self, rows: list[int], ids: list[int]) -> None:
        """Record fast-forwarded tokens (``ids[i]`` appended to row ``rows[i]``): penalties
        count them like sampled ones, and seeded rows sample at their true output position."""
        if not rows:
            return
        self.penalizer_orchestrator.cumulate_output_tokens(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(rows, dtype=torch.int64, device=self.device))
        for r in rows:
            self.positions[r] += 1

    # ---- the logits pipeline ------------------------------------------------------------
    def start_vocab_mask_fill(self, executor: Optional[Executor]) -> None:
        """Start filling this step's bitmask on ``executor`` (the grammar libraries release
        the GIL), so it overlaps the forward; ``update_regex_vocab_mask`` collects it. The
        grammars must not change until then (the scheduler accepts tokens only after).
        No executor: the fill runs in line, in ``update_regex_vocab_mask``."""
        if executor is not None and any(g is not None for g in self.grammars):
            self._mask_future = executor.submit(self._fill_vocab_mask_ahead)

    def mask_fill_started(self) -> bool:
        return self._mask_future is not None

    def _fill_vocab_mask_ahead(self):
        # Inference mode is per thread; the buffer is also filled under it by sample().
        with torch.inference_mode():
            return self._fill_vocab_mask()

    def update_regex_vocab_mask(self) -> None:
        """This step's grammar bitmask: one int32 row per request, ``ceil(V/32)`` words
        wide for the model's (padded) vocabulary V. Rows of unconstrained requests and of
        grammars that are finished, terminated or still reasoning allow every token; no
        such row at all means no mask. Taken from the fill started ahead, if any."""
        start = time.perf_counter()
        future, self._mask_future = self._mask_future, None
        buf, dead, work = future.result() if future is not None else self._fill_vocab_mask()
        self.failed_rows += [(i, DEAD_END_MESSAGE, 400) for i in dead]
        if buf is not None:
            source = next(g for g in self.grammars if g is not None)
            self.vocab_mask = source.move_vocab_mask(buf, self.device)
        else:
            self.vocab_mask = None
        self.mask_fill_seconds = time.perf_counter() - start
        self.mask_fill_work_seconds = work

    def _fill_vocab_mask(self) -> tuple[Optional[torch.Tensor], list[int], float]:
        """(host bitmask or None, rows whose grammar allows no token, seconds taken)."""
        start = time.perf_counter()
        rows = [i for i, g in enumerate(self.grammars) if g is not None and g.needs_vocab_mask()]
        if not rows:
            return None, [], time.perf_counter() - start
        first = self.grammars[rows[0]]
        buf = self._mask_buffer
        if buf is None or buf.shape[0] != len(self):
            buf = self._mask_buffer = first.allocate_vocab_mask(self.vocab_size, len(self), self.device)
        else:  # numpy: single-threaded, so a fill beside the forward never starts a
            buf.numpy().fill(-1)  # second OpenMP team on the forward's cores
        batched: dict[int, tuple[Any, list, list[int]]] = {}
        for i in rows:
            source = self.grammars[i].mask_source()
            if source.mask_filler is None:
                source.fill_vocab_mask(buf, i)
            else:  # one library call per backend fills its rows on its own threads
                group = batched.setdefault(id(source.mask_filler), (source.mask_filler, [], []))
                group[1].append(source)
                group[2].append(i)
        for filler, grammars, idx in batched.values():
            filler.fill(grammars, buf, idx)
        return buf, self._dead_rows(buf, rows), time.perf_counter() - start

    def _dead_rows(self, buf: torch.Tensor, rows: list[int]) -> list[int]:
        """A grammar that allows no token here (its row is all zero, or the library reports
        a dead end) can never be completed: that request is aborted with a 400. Rows
        without a grammar are all ones, so the whole buffer is checked at once."""
        empty = (~buf.numpy().any(axis=1)).tolist()
        return [i for i in rows if empty[i] or self.grammars[i].has_error()]

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """In place, in this order: penalties, custom processors, vocab mask, logit bias.
        The mask comes after the processors so none can raise a token the grammar forbids
        (the grammar would reject the sampled token and the request would fail)."""
        if self.penalizer_orchestrator.is_required:
            self.penalizer_orchestrator.apply(logits)
        if any(p is not None for p in self.custom_processors):
            self._apply_custom_processors(logits)
        self.apply_vocab_mask(logits)
        if any(self.logit_bias):  # finite (validated): -inf + b stays -inf
            rows, cols, vals = self._logit_bias_index()
            logits.index_put_((rows, cols), vals, accumulate=True)

    def apply_vocab_mask(self, logits: torch.Tensor) -> None:
        """The grammar mask alone (after the bias is fine too: -inf + b stays -inf)."""
        if self.vocab_mask is not None:
            start = time.perf_counter()
            apply_token_bitmask_inplace(logits, self.vocab_mask)  # sets -inf, whatever was there
            self.mask_apply_seconds = time.perf_counter() - start

    def _logit_bias_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sparse (row, token, bias) triples, cached until the rows change."""
        if self._bias_index is None:
            rows = [i for i, pairs in enumerate(self.logit_bias) for _ in pairs]
            cols = [t for pairs in self.logit_bias for t, _ in pairs]
            vals = [b for pairs in self.logit_bias for _, b in pairs]
            self._bias_index = (torch.tensor(rows, dtype=torch.int64, device=self.device),
                                torch.tensor(cols, dtype=torch.int64, device=self.device),
                                torch.tensor(vals, dtype=torch.float32, device=self.device))
        return self._bias_index

    def _apply_custom_processors(self, logits: torch.Tensor) -> None:
        from sampling.custom_logit_processor import CustomLogitProcessor

        groups: dict[str, list[int]] = {}
        for i, name in enumerate(self.custom_processors):
            if name is not None:
                groups.setdefault(name, []).append(i)
        for name, rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            try:
                processor = CustomLogitProcessor.from_str(name)
                logits[idx] = processor(logits[idx], [self.custom_params[i] for i in rows])
            except Exception as e:  # a buggy user processor must not take the server down
                self.failed_rows += [(i, f"Custom logit processor failed: {type(e).__name__}: {e}", 500)
                                     for i in rows]

    def take_failed_rows(self) -> dict[int, tuple[str, int]]:
        """Rows to abort after this step: row -> (message, HTTP status); cleared on read."""
        failed, self.failed_rows = {i: (m, code) for i, m, code in self.failed_rows}, []
        return failed
