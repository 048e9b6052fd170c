"""Batched penalizers (frequency, presence, repetition, min_new_tokens) and the
orchestrator that runs the ones a batch needs."""
from sampling.penaltylib.orchestrator import PENALIZER_ORDER, BatchedPenalizerOrchestrator

__all__ = ["BatchedPenalizerOrchestrator", "PENALIZER_ORDER"]
