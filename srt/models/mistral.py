"""Mistral: the Llama decoder (sliding-window attention is capped, see ModelConfig)."""
from srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
