"""Qwen2: the Llama decoder with a bias on q/k/v (not on o_proj)."""
from srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
