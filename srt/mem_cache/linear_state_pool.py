"""Per-request recurrent state of the hybrid models' Gated DeltaNet layers.

One slot per request row of the ReqToTokenPool (slot = ``req_pool_idx``), so a slot lives
exactly as long as the request's row: admission takes it, finish / abort / retraction free
it, and the idle-integrity check of the rows covers the slots too. A slot's content is
only read when the step says the request continues a sequence (a prefill chunk after the
first, a decode row); a request's first forward starts from zeros instead, so a reused
slot never needs clearing.

    conv       [L, slots, conv_dim, K-1]  the model's dtype (the conv's last K-1 inputs)
    recurrent  [L, slots, Hv, Dk, Dv]     fp32 (a running sum over the whole sequence)

Speculative decoding: a state cannot be cropped, and one that absorbed rejected drafts is
wrong. A step with drafts keeps, for each request with several rows, its state after every
row (``RowStates``, per-position states); when the scheduler then keeps only the first
``length`` tokens (``KVCacheManager.truncate``), ``rollback`` puts the state after the last
kept row into the slot. Cost: one state (every GDN layer) per drafted row, for that step only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowStates:
    """One request's states after each of its rows in this step (speculative decoding)."""

    first_len: int            # the sequence length after its first row
    conv: torch.Tensor        # [L, rows, conv_dim, K-1]
    recurrent: torch.Tensor   # [L, rows, Hv, Dk, Dv]


class LinearStatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], conv_dtype: torch.dtype, device):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.conv = torch.zeros(num_layers, num_slots, *conv_shape, dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, *recurrent_shape, dtype=torch.float32,
                                     device=device)
        self.row_states: dict[int, RowStates] = {}  # this step's, by slot
        self.rollbacks = 0  # states put back to a kept row (rejected drafts), for tests and stats

    def begin_step(self) -> None:
        self.row_states.clear()

    def keep_rows(self, slot: int, first_len: int, rows: int) -> RowStates:
        kept = RowStates(first_len,
                         self.conv.new_empty(self.num_layers, rows, *self.conv.shape[2:]),
                         self.recurrent.new_empty(self.num_layers, rows, *self.recurrent.shape[2:]))
        self.row_states[slot] = kept
        return kept

    def rollback(self, slot: int, length: int) -> None:
        """The request in ``slot`` keeps its first ``length`` tokens: its state becomes the one
        after the row at position ``length - 1`` of this step."""
        kept = self.row_states.get(slot)
        row = -1 if kept is None else length - kept.first_len
        if kept is None or not 0 <= row < kept.conv.shape[1]:
            # Never serve a state that absorbed rejected tokens.
            raise RuntimeError(f"linear-state rollback of slot {slot} to length {length}: "
                               "no state of that row was kept this step")
        self.conv[:, slot] = kept.conv[:, row]
        self.recurrent[:, slot] = kept.recurrent[:, row]
        self.rollbacks += 1

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_shape: tuple[int, ...], recurrent_shape: tuple[int, ...],
                       conv_dtype: torch.dtype) -> int:
        conv = num_layers * torch.Size(conv_shape).numel() * torch.empty(0, dtype=conv_dtype).element_size()
        return conv + num_layers * torch.Size(recurrent_shape).numel() * 4

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


def state_pool_for(model, num_slots: int, device) -> LinearStatePool | None:
    """The pool a hybrid model's GDN layers need (``model.linear_layers()``); None for a
    model without them. A pipeline stage of a hybrid that holds none gets an empty pool (no
    layers), so its slot and checkpoint bookkeeping stays the other stages'."""
    if not getattr(model, "is_hybrid", False):
        return None
    layers = model.linear_layers()
    if not layers:
        return LinearStatePool(0, num_slots, (1,), (1,), torch.float32, device)
    conv_shape, rec_shape = layers[0].state_shapes()
    return LinearStatePool(len(layers), num_slots, conv_shape, rec_shape, layers[0].conv1d.weight.dtype, device)
