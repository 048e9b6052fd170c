"""The scheduler process: one per rank, the same loop on every rank (see docs)."""
