"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of ``64 * tp_size`` so every rank holds an equal,
aligned shard of rows ``[rank * V_local, (rank + 1) * V_local)``; padded rows are zero.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from distributed.communication import tp_all_gather_last_dim, tp_all_reduce
from distributed.parallel_state import TPGroup
from srt.layers.cpu_packed_linear import linear

DEFAULT_VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, tp_size: int, align: int = DEFAULT_VOCAB_PADDING) -> int:
    multiple = align * tp_size
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = TPGroup(),
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.tp = tp
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, tp.size)
        self.num_embeddings_per_rank = self.num_embeddings_padded // tp.size
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.embedding_dim = embedding_dim
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if loaded_weight.shape[1] != self.embedding_dim or loaded_weight.shape[0] != self.org_vocab_size:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded_weight.shape)}, expected "
                             f"({self.org_vocab_size}, {self.embedding_dim})")
        real_end = min(self.vocab_end, self.org_vocab_size)
        n = max(real_end - self.vocab_start, 0)
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_start + n])
        param.data[n:].zero_()  # padded rows: zero, so padded logits are 0 and never win

    def forward_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embeddings: rows of other ranks' tokens are zero."""
        if self.tp.is_single:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        return out.masked_fill_(~in_shard.unsqueeze(-1), 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Exactly one rank contributes each token's row, so the sum is the full embedding.
        return tp_all_reduce(self.forward_local(input_ids), self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """``logits = hidden @ W^T`` per vocab shard, gathered to ``[..., vocab_size]`` fp32.

    With tied embeddings, :meth:`tie_to` shares the embedding's Parameter (same sharding).
    """

    packed_weight: Optional[torch.Tensor] = None  # set by pack_linear_weights (CPU, eager)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        assert embedding.num_embeddings_padded == self.num_embeddings_padded
        self.weight = embedding.weight

    def forward_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight, self.packed_weight)

    def forward(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """``float32=False`` keeps the matmul's dtype (prompt-logprob rows: their
        log-softmax upcasts as it reads, so no float32 copy of ``[rows, vocab]``)."""
        logits = tp_all_gather_last_dim(self.forward_local(hidden_states), self.tp)
        logits = logits[..., : self.org_vocab_size]
        return logits.float() if float32 else logits
