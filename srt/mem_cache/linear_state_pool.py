"""Per-request recurrent state of the hybrid models' Gated DeltaNet layers.

One slot per request row of the ReqToTokenPool (slot = ``req_pool_idx``), so a slot lives
exactly as long as the request's row: admission takes it, finish / abort / retraction free
it, and the idle-integrity check of the rows covers the slots too. A slot's content is
only read when the step says the request continues a sequence (a prefill chunk after the
first, a decode row); a request's first forward starts from zeros instead, so a reused
slot never needs clearing.

    conv       [L, slots, conv_dim, K-1]  the model's dtype (the conv's last K-1 inputs)
    recurrent  [L, slots, Hv, Dk, Dv]     fp32 (a running sum over the whole sequence)
"""
from __future__ import annotations

import torch


class LinearStatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], conv_dtype: torch.dtype, device):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.conv = torch.zeros(num_layers, num_slots, *conv_shape, dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, *recurrent_shape, dtype=torch.float32,
                                     device=device)

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
    model without them, or a pipeline stage that holds none."""
    layers = model.linear_layers() if getattr(model, "is_hybrid", False) else []
    if not layers:
        return None
    conv_shape, rec_shape = layers[0].state_shapes()
    return LinearStatePool(len(layers), num_slots, conv_shape, rec_shape, layers[0].conv1d.weight.dtype, device)
