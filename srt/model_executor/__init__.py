"""Model execution: the runner, forward batches, loading, and the compiled steps (compiled/)."""
