"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE."""
from srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
