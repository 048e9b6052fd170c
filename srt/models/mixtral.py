"""Mixtral: Mistral's attention, every layer a sparse block (``block_sparse_moe``) whose
router always renormalises its top-k."""
from srt.models.moe_decoder import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    block_prefix = "block_sparse_moe."
