"""Compiled decode/prefill steps, their AOTInductor packages, the on-disk cache and its builder process."""
