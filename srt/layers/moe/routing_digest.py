"""A running hash of the experts a step's tokens were routed to, for the batch log.

Every rank of a TP group routes the same tokens with a replicated router, so every rank
must pick the same experts; the batch log writes this digest after each step
(``<step> ROUTING <hex>``) and the ranks' logs must match, which catches a routing
difference between ranks the token agreement would only see later, if at all. Updated in
eager steps only: inside a compiled graph the router's choice is not observable without
a graph break, so a step that ran compiled records no digest.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

from srt.layers.moe.fused_moe import FusedMoE


class RoutingDigest:
    def __init__(self):
        self._hash: Optional["hashlib._Hash"] = None

    def add(self, topk_ids: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return
        if self._hash is None:
            self._hash = hashlib.blake2b(digest_size=8)
        self._hash.update(topk_ids.to(torch.int32).contiguous().numpy().tobytes())

    def pop(self) -> Optional[str]:
        """The digest of the routing since the last pop; None when no eager step routed."""
        h, self._hash = self._hash, None
        return None if h is None else h.hexdigest()


def attach_routing_digest(model: torch.nn.Module) -> Optional[RoutingDigest]:
    """One digest shared by every MoE layer of ``model``; None for a dense model."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    digest = RoutingDigest()
    for layer in layers:
        layer.routing_digest = digest
    return digest
