"""qwen3_next (Qwen3-Next-80B): Gated DeltaNet layers (fused qkvz projection) and gated attention,
zero-centred norms, a shared expert."""

from moestream.models.base import CausalLM, ModelSpec


class Model(CausalLM):
    spec = ModelSpec(zero_centered_norms=True, attention_output_gate=True, fused_qkvz=True, shared_expert=True)
