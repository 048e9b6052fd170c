"""What a hybrid Gated DeltaNet model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) is served with today.

A recurrent state cannot be cropped or shared the way KV can, so every path that would reuse
or roll back a state needs its own mechanism; until one is built and tested, the combination
is refused with a clear message or switched off (and said so), never served approximately:

- the radix prefix cache keeps recurrent-state checkpoints (scheduler/hybrid_state_cache.py);
  the prompt-logprob cache, which would need a state at every scored position, is off;
- torch.compile / AOTInductor / CUDA graphs: off, the step runs eagerly (the compiled steps
  are traced without the state pool);
- refused: --torchao-config, --enable-torch-compile.

Speculative decoding is served: a step with drafts keeps each row's state and rejected drafts
are rolled back (mem_cache/linear_state_pool.py).
"""
from __future__ import annotations

import dataclasses
import logging

from srt.model_executor.model_config import ModelConfig
from srt.models.registry import model_class
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _refuse(cfg: ModelConfig, what: str, why: str) -> ValueError:
    return ValueError(f"{cfg.architecture} is a hybrid Gated DeltaNet model: {what} is not built yet "
                      f"for it ({why}); serve it without (docs/models.md 'Hybrid models')")


def hybrid_serving_args(args: ServerArgs, cfg: ModelConfig, log_prefix: str = ""
                        ) -> tuple[ServerArgs, tuple[str, ...]]:
    """``(args as served, what was switched off)``; ValueError for a refused combination."""
    if not getattr(model_class(cfg.architecture), "is_hybrid", False):
        return args, ()
    if args.torchao_config:
        raise _refuse(cfg, f"--torchao-config {args.torchao_config}", "quantized GDN projections")
    if args.enable_torch_compile:
        raise _refuse(cfg, "--enable-torch-compile", "compiled steps with the state pool")
    changes: dict[str, bool] = {}
    notes = []
    if not args.disable_prompt_logprob_cache and not args.disable_radix_cache:
        changes["disable_prompt_logprob_cache"] = True
        notes.append("prompt-logprob cache off (it would need a recurrent state at every scored "
                     "position): prompt logprobs are computed again for each request")
    if not args.disable_torch_compile:
        changes["disable_torch_compile"] = True
        notes.append("torch.compile off: every step runs eagerly")
    if not args.disable_cuda_graph:
        changes["disable_cuda_graph"] = True
        notes.append("CUDA graphs off")
    for note in notes:
        logger.info("%s %s: %s", log_prefix, cfg.architecture, note)
    return dataclasses.replace(args, **changes), tuple(notes)
