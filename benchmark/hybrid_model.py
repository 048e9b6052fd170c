"""A Qwen3.5-shaped random-weight hybrid model of about 130M parameters for the benchmarks
(bench_hybrid.py): SmolLM2's tokenizer and vocabulary, 20 layers (15 Gated DeltaNet, 5 gated
full attention: Qwen3.5's 3:1 pattern), hidden 640, partial RoPE 0.25; tied embeddings.

Written once as an ordinary Hugging Face directory (transformers' ``save_pretrained``) under
``$GRAMSYNC_CACHE_DIR/bench_hybrid/<recipe hash>``; random weights, so its outputs say nothing
about quality, only about speed and exactness.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

CONFIG = dict(hidden_size=640, intermediate_size=1920, num_hidden_layers=20, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4)
INIT_STD = 0.05
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def hybrid_model_dir() -> str:
    import torch
    import transformers as tf

    from srt import environ
    from srt.model_executor.model_loader import resolve_model_path

    smollm2 = resolve_model_path(None)
    with open(os.path.join(smollm2, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    key = hashlib.sha256(json.dumps([CONFIG, vocab, INIT_STD, tf.__version__], sort_keys=True).encode()).hexdigest()[:16]
    target = os.path.join(environ.GRAMSYNC_CACHE_DIR.get(), "bench_hybrid", key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    config = tf.Qwen3_5TextConfig(vocab_size=vocab, initializer_range=INIT_STD, **CONFIG)
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.normal_(0.0, INIT_STD)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2, name)):
            shutil.copy(os.path.join(smollm2, name), os.path.join(tmp, name))
    try:
        os.rename(tmp, target)
    except OSError:  # built concurrently
        shutil.rmtree(tmp, ignore_errors=True)
    return target
