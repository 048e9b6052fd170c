"""The suite's tiny model: SmolLM2's tokenizer, vocabulary and chat template on a small
random-weight Llama, for the tests that own their schedulers, engines or servers and whose
verdicts do not depend on trained weights (docs/testing.md says which use it and why).

Built in-process from a transformers ``LlamaConfig`` with a fixed seed and written as an
ordinary Hugging Face directory (``save_pretrained`` writes the hub's tensor names), so
servers load it through the same loader as any checkpoint (``--model-path``). Cached under
``$GRAMSYNC_CACHE_DIR/tiny`` by a hash of its recipe; a rebuild is ~1 s.

Shape: 4 layers (PP=2 gets two a stage), 4 query heads and 2 KV heads of 64 (TP=2 splits
both), hidden 256, MLP 512, tied embeddings (SmolLM2's layout): ~13.5M parameters, most in
the 49,152 x 256 embedding. Its weights are drawn with a wider spread than transformers'
default (``INIT_STD``), so a greedy step's top two logits stand far apart compared with
fp32 rounding: greedy outputs stay the same in any batch, as the suite's equality tests
need.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
              rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# The MoE twin (tiny_moe_dir): the same attention, Qwen3-MoE's blocks (8 experts, 2 a token;
# layer 2 dense through mlp_only_layers, so both kinds of layer are served).
MOE_CONFIG = dict(CONFIG, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2])
# The hybrid twin (tiny_hybrid_dir): Qwen3.5's dense hybrid, three Gated DeltaNet layers then
# one gated full-attention layer (layer_types L L L F), partial RoPE as Qwen3.5's (0.25).
HYBRID_CONFIG = dict({k: v for k, v in CONFIG.items() if k != "rope_theta"},
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0,
                                      "partial_rotary_factor": 0.25},
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4)
# The thinking twin (tiny_think_dir): the Llama with SmolLM2's tokenizer plus <think> and
# </think> as single (non-special, as in Qwen's) tokens and a Qwen3.5-style chat template:
# the generation prompt opens <think>; enable_thinking false writes the empty block instead.
THINK_TOKENS = ("<think>", "</think>")
THINK_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
INIT_STD = 0.08
SEED = 0
# Not generation_config.json: save_pretrained writes the tiny model's own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _recipe_key(vocab_size: int, family: str) -> str:
    import transformers

    config = {"llama": CONFIG, "qwen3_moe": MOE_CONFIG, "qwen3_5": HYBRID_CONFIG, "llama_think": CONFIG}[family]
    recipe = {"config": config, "vocab": vocab_size, "std": INIT_STD, "seed": SEED,
              "transformers": transformers.__version__}
    if family != "llama":  # the Llama recipe's key stays what it was
        recipe["family"] = family
    if family == "llama_think":
        recipe["think"] = [THINK_TOKENS, THINK_TEMPLATE]
    recipe = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def tiny_model_dir(smollm2_dir: str, cache_root: str, family: str = "llama") -> str:
    """The tiny model's directory (built once, then reused; safe against a concurrent build).
    ``family``: ``llama``, ``qwen3_moe`` for the mixture-of-experts twin, ``qwen3_5`` for the
    hybrid Gated DeltaNet twin, ``llama_think`` for the thinking twin (THINK_TOKENS)."""
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    target = os.path.join(cache_root, "tiny", _recipe_key(vocab, family))
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _build(smollm2_dir, vocab, tmp, family)
    try:
        os.rename(tmp, target)  # atomic: a reader sees the whole directory or none
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(smollm2_dir: str, vocab: int, out: str, family: str) -> None:
    import torch
    import transformers as tf

    if family in ("llama", "llama_think"):
        vocab += len(THINK_TOKENS) if family == "llama_think" else 0
        config, cls = tf.LlamaConfig(vocab_size=vocab, initializer_range=INIT_STD, **CONFIG), tf.LlamaForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(vocab_size=vocab, initializer_range=INIT_STD, **MOE_CONFIG)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen3_5":
        config = tf.Qwen3_5TextConfig(vocab_size=vocab, initializer_range=INIT_STD, **HYBRID_CONFIG)
        cls = tf.Qwen3_5ForCausalLM
    else:
        raise KeyError(family)
    config.architectures = [cls.__name__]
    torch.manual_seed(SEED)
    model = cls(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 1 (Qwen3.5's (1 + w) at 0): keep them
        for name, p in model.named_parameters():
            if not name.endswith(("norm.weight", "A_log", "dt_bias")):  # keep the GDN's decay init
                p.normal_(0.0, INIT_STD)
    os.makedirs(out)
    model.save_pretrained(out, safe_serialization=True)
    if family == "llama_think":
        tok = tf.AutoTokenizer.from_pretrained(smollm2_dir)
        tok.add_tokens(list(THINK_TOKENS), special_tokens=False)
        tok.chat_template = THINK_TEMPLATE
        tok.save_pretrained(out)
        return
    for name in TOKENIZER_FILES:
        src = os.path.join(smollm2_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out, name))
