"""Serve a 4-bit GGUF in its own precision: the file's Q4_0 / Q4_1 codes and scales, the
default for such a file on CPU.

A quantized GGUF was dequantized at load and served dense, so a user who compared gramsync
with llama.cpp on the same file compared a dense model with a 4-bit one; re-quantizing it
(``--torchao-config int4wo-32``) rounds a second time. Here each decoder linear layer
takes the codes the GGUF conversion kept (gguf_int4_codes.py) with the file's scales, on
torch's CPU int4 kernel (cpu_int4_linear.py; value = (code - 8) * scale + zero with bf16
scale = d and zero = m + 8 d, so the file's fp16 d and m are rounded to bf16: at most 1/64
of a quantization step). The LM head goes to int8 with one scale per row (the CPU int8
kernel's layout; the file's Q8_0 has one scale per 32, so that table is re-rounded, as with
``--torchao-config int4wo-<g>``), and the embedding stays dense.

The codes reach each layer through the model's own weight loaders, so TP sharding, fused
q/k/v and gate/up, pipeline stages and padded heads place them as they place the dense
weights: a decoder layer at a time, each linear layer's weight is swapped, for one pass
each, for a uint8 (codes) or fp32 (scale, minimum, repeated over their 32 inputs) tensor of
its shape.
"""
from __future__ import annotations

import logging
import os
import re

import torch
from torch import nn

from srt.layers.cpu_gemv import gemv_max_rows
from srt.layers.cpu_int4_linear import int4_from_codes, int4_supported
from srt.layers.cpu_qgemv import PanelInt4, SmallBatchQuantized, fits, pack_int4, qgemv_available
from srt.layers.cpu_int8_linear import int8_supported
from srt.layers.linear import _TPLinear
from srt.layers.weight_packing import quantize_head_int8
from srt.model_executor.gguf_int4_codes import GGUF_INT4_FILE, GROUP
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_UNSET = 255  # no code: a layer the file holds no Q4 codes for
# Steps of up to this many rows run the codes (eager: every such step; compiled: the graphs
# whose rows are known to be this few); larger ones the dequantized weight. On torch's int4
# kernel, compute-bound, that is batch 1 (cpu_qgemv.SmallBatchQuantized); our int4 GEMV
# (cpu_qgemv.py, AVX512-BF16) reads the codes at the machine's rate, up to the 16 rows of
# the small-batch graphs (docs/speed.md "Quantized GEMVs"); 4 with AMX tiles, where
# oneDNN's bf16 matmul is faster above (cpu_gemv.gemv_max_rows).
INT4_MAX_ROWS = 4
PANEL_INT4_MAX_ROWS = 16


def gguf_int4_choice(args: ServerArgs, model_dir: str, device: str, model: nn.Module) -> tuple[bool, str]:
    """(serve the GGUF's own 4-bit codes, why or why not) for a converted GGUF folder;
    (False, "") for any other checkpoint."""
    if not os.path.isfile(os.path.join(model_dir, GGUF_INT4_FILE)):
        return False, ""
    if args.torchao_config:
        return False, f"--torchao-config {args.torchao_config} given"
    if args.dtype != "auto":
        return False, f"--dtype {args.dtype} given: the file's 4-bit weights dequantized to {args.dtype}"
    if not device.startswith("cpu"):
        return False, "the file's 4-bit codes run on torch's CPU int4 kernel; on CUDA they are dequantized"
    if not (int4_supported() and int8_supported()):
        return False, "this torch has no CPU int4 / int8 kernel"
    if args.speculative_algorithm == "NGRAM":  # a verify step's rows compute what plain steps do
        return False, ("--speculative-algorithm given: drafts are verified in steps of several rows, "
                       "which must compute what a plain step does; the codes' steps do not promise that "
                       "(they may read other weights or graphs by row count), so every step is served dense")
    if model.has_experts or model.is_hybrid:
        return False, "4-bit experts and Gated DeltaNet projections are not built yet"
    return True, "a 4-bit GGUF on CPU with --dtype auto; --dtype or --torchao-config serve it otherwise"


def load_gguf_int4(model: nn.Module, model_dir: str, log_prefix: str) -> int:
    """Give every decoder linear layer the file's codes (a ``SmallBatchQuantized``: its dense
    weight stays for steps of more rows) and the LM head int8. Returns the number of linear
    layers. ValueError, with the model left as it was, where a
    layer has no Q4 codes in the file or its inputs are not whole groups."""
    from safetensors import safe_open

    linears = {name: m for name, m in model.named_modules() if isinstance(m, _TPLinear)}
    for name, m in linears.items():
        if m.weight.shape[1] % GROUP:
            raise ValueError(f"{name} holds {m.weight.shape[1]} inputs on this rank, not whole groups of {GROUP}")
    weights = {}
    with safe_open(os.path.join(model_dir, GGUF_INT4_FILE), framework="pt", device="cpu") as f:
        file_names = sorted({k.rsplit(".", 1)[0] for k in f.keys()})
        for layer, names in _by_layer(linears).items():  # a layer at a time: the stand-ins stay small
            hf_names = [n for n in file_names if _layer_of(n) == layer]
            codes = _through_loaders(model, names, hf_names, lambda n: f.get_tensor(f"{n}.codes"), torch.uint8)
            missing = [name for name, c in codes.items() if bool((c == _UNSET).any())]
            if missing:
                raise ValueError(f"{missing[0]} has no Q4_0 / Q4_1 codes in the file")
            scale, minv = (_through_loaders(model, names, hf_names,
                                            lambda n, p=part: _per_input(f.get_tensor(f"{n}.{p}")), torch.float32)
                           for part in ("scale", "min"))
            ours = qgemv_available()
            for name in names:
                weights[name] = _pack(codes[name], scale[name][:, ::GROUP], minv[name][:, ::GROUP], ours)
    ours = all(isinstance(w, PanelInt4) for w in weights.values())
    max_rows = min(PANEL_INT4_MAX_ROWS, gemv_max_rows(torch.bfloat16)) if ours else INT4_MAX_ROWS
    for name, m in linears.items():  # the dense weight stays for steps of more rows
        m.packed_weight = SmallBatchQuantized(weights[name], None, max_rows)
    quantize_head_int8(model, log_prefix)
    logger.info("%s the GGUF's own 4-bit codes (group %d, %s) for %d linear layers in steps of up to "
                "%d rows; the file dequantized above", log_prefix, GROUP,
                "gramsync's int4 GEMV" if ours else "torch's CPU int4 kernel", len(linears), max_rows)
    return len(linears)


def _pack(codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, ours: bool):
    """The kernels' convention: value = (code - 8) * scale + zero, bf16; the file's: scale *
    code + min. ``ours``: for our int4 GEMV (the same values), else torch's kernel."""
    scale_bf16, zero_bf16 = scale.to(torch.bfloat16), (minv + 8 * scale).to(torch.bfloat16)
    if ours and fits(*codes.shape):
        return pack_int4(codes, scale_bf16, zero_bf16)
    return int4_from_codes(codes, scale_bf16, zero_bf16, GROUP)


def _layer_of(name: str) -> int:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def _by_layer(linears: dict[str, _TPLinear]) -> dict[int, dict[str, _TPLinear]]:
    out: dict[int, dict[str, _TPLinear]] = {}
    for name, m in linears.items():
        out.setdefault(_layer_of(name), {})[name] = m
    return out


def _per_input(per_group: torch.Tensor) -> torch.Tensor:
    """[N, K / 32] -> [N, K]: the weight's shape, so the loaders slice it as they slice it."""
    return per_group.repeat_interleave(GROUP, dim=1)


def _through_loaders(model: nn.Module, linears: dict[str, _TPLinear], hf_names: list[str],
                     tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each linear layer's slice of the named file tensors, placed by the model's own
    loaders into a stand-in weight of the layer's shape; the real weights are put back."""
    originals = {name: m.weight for name, m in linears.items()}
    try:
        for m in linears.values():
            stand_in = nn.Parameter(torch.full(m.weight.shape, _UNSET, dtype=dtype), requires_grad=False)
            stand_in.weight_loader = m.weight_loader
            m.weight = stand_in
        model.load_weights(((n, tensor(n)) for n in hf_names), only={f"{name}.weight" for name in linears})
        return {name: m.weight.data for name, m in linears.items()}
    finally:
        for name, m in linears.items():
            m.weight = originals[name]


def codes_at_every_row(model: nn.Module) -> int:
    """Let every step, of any row count, run the codes and the int8 head (eager steps only): to measure their
    quality over a whole prefill (bench_quant.py, tests). Returns the layers changed."""
    count = 0
    for m in model.modules():
        if isinstance(getattr(m, "packed_weight", None), SmallBatchQuantized):
            m.packed_weight = m.packed_weight._replace(max_rows=2**62)
            count += 1
    return count
