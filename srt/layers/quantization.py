"""Weight-only quantization with torchao (``--torchao-config``, SGLang's flag and values).

- ``int8wo``: every linear layer of the decoder (q/k/v, o, gate/up, down) keeps its
  weight as int8 with one scale per output row (torchao ``Int8WeightOnlyConfig``); the
  matmul dequantizes on the fly, so batch-1 decode reads half (bf16) or a quarter (fp32)
  of the bytes.
- ``int4wo-<group>``: 4-bit weights with one scale and zero per ``group`` inputs. On CUDA
  torchao's ``Int4WeightOnlyConfig``; on CPU torch's own int4 kernel with torchao's
  quantization (``cpu_int4_linear.py``), and on CPU the LM head in int8 with one scale
  per row (``cpu_int8_linear.py``): the embedded model's GGUF stores that table as Q8_0,
  where the decoder's linear layers are Q4_1, and an int4 head cost 6% perplexity.
The embedding stays unquantized (a row lookup: no matmul to speed up; a tied head keeps
reading the same dense table), and so does the LM head except with int4 on CPU.
"""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def _is_decoder_linear(module: nn.Module, fqn: str) -> bool:
    from srt.layers.linear import _TPLinear

    return isinstance(module, _TPLinear)


def _int4_group(config: str) -> int:
    group = config.removeprefix("int4wo-")
    if group not in ("32", "64", "128", "256"):
        raise ValueError(f"--torchao-config {config}: the group size must be 32, 64, 128 or 256")
    return int(group)


def apply_torchao_config(model: nn.Module, config: str, device: str, log_prefix: str = "") -> None:
    """Quantize ``model``'s linear layers in place; ValueError for what cannot run here."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise ValueError(f"--torchao-config {config} needs the torchao package "
                         f"(pip install torchao): {e}") from None
    if config == "int8wo":
        ao_config = Int8WeightOnlyConfig()
    elif config.startswith("int4wo-"):
        group = _int4_group(config)
        if not str(device).startswith("cuda"):
            from srt.layers.cpu_int4_linear import int4_supported
            from srt.layers.weight_packing import quantize_model_int4

            if not int4_supported():
                raise ValueError(f"--torchao-config {config}: this torch has no CPU int4 kernel")
            from srt.layers.cpu_int8_linear import int8_supported
            from srt.layers.weight_packing import quantize_head_int8

            quantize_model_int4(model, group, log_prefix, head=False)
            if int8_supported():
                quantize_head_int8(model, log_prefix)
            return
        ao_config = Int4WeightOnlyConfig(group_size=group)
    else:
        raise ValueError(f"Unknown --torchao-config {config!r}")
    before = _weight_bytes(model)
    quantize_(model, ao_config, filter_fn=_is_decoder_linear)
    logger.info("torchao %s: linear weights %.1f MiB -> %.1f MiB", config,
                before / 2**20, _weight_bytes(model) / 2**20)


def _weight_bytes(model: nn.Module) -> int:
    from srt.layers.linear import _TPLinear

    total = 0
    for m in model.modules():
        if isinstance(m, _TPLinear):
            w = m.weight
            inner = [getattr(w, a) for a in getattr(w, "__tensor_flatten__", lambda: ([], None))()[0]]
            total += sum(t.numel() * t.element_size() for t in inner) if inner else w.numel() * w.element_size()
    return total
