"""qwen3_5_moe (Qwen3.5 MoE, text model): as qwen3_next with separate DeltaNet projections and
routed experts on every layer."""

from moestream.models.base import CausalLM, ModelSpec


class Model(CausalLM):
    spec = ModelSpec(zero_centered_norms=True, attention_output_gate=True, fused_qkvz=False, shared_expert=True)
