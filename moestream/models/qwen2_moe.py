"""qwen2_moe (Qwen1.5/2-MoE): qkv bias, no q/k norm, a shared expert scaled by a sigmoid gate."""

from moestream.models.base import CausalLM, ModelSpec


class Model(CausalLM):
    spec = ModelSpec(qk_norm=False, shared_expert=True)
