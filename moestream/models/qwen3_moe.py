"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with q/k RMSNorm, routed experts,
dense MLP layers where `decoder_sparse_step` / `mlp_only_layers` say."""

from moestream.models.base import CausalLM, ModelSpec


class Model(CausalLM):
    spec = ModelSpec(qk_norm=True)
