"""The decoder shared by every Qwen MoE type, configured by a small spec per model type.

Module names follow the checkpoints (`model.layers.N.self_attn.q_proj`, `mlp.gate`, `lm_head`), so the
store's dense tensors load by name. A forward takes token ids and a `SequenceState` and advances it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.attention import Attention
from moestream.layers.deltanet import GatedDeltaNet
from moestream.layers.mlp import MLP
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import Rotary


@dataclass(frozen=True)
class ModelSpec:
    zero_centered_norms: bool = False  # (1 + w) RMSNorm (qwen3_next family)
    qk_norm: bool = True
    attention_output_gate: bool = False
    fused_qkvz: bool = False  # qwen3_next's DeltaNet projection layout
    deltanet_gate: str = "silu"
    shared_expert: bool = False


@dataclass
class SequenceState:
    """Everything a sequence carries between forwards: per-layer caches and the token count."""

    layers: list
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    def snapshot(self) -> SequenceState:
        return SequenceState([s.snapshot() for s in self.layers], self.length, list(self.tokens))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec, index: int, layer_slot: int | None):
        super().__init__()
        self.kind = cfg.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, spec.fused_qkvz, spec.deltanet_gate)
        else:
            self.self_attn = Attention(cfg, spec.qk_norm, spec.attention_output_gate, spec.zero_centered_norms)
        if layer_slot is None:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = SparseMoE(cfg, layer_slot, spec.shared_expert)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def mix(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        if self.kind == "linear_attention":
            return self.linear_attn(x, state)
        return self.self_attn(x, rope, state)

    def forward(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        x = x + self.mix(self.input_layernorm(x), rope, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        slots = {layer: s for s, layer in enumerate(cfg.moe_layer_ids)}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i, slots.get(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)


class CausalLM(nn.Module):
    spec = ModelSpec()
    backbone_class = Backbone

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.backbone_class(cfg, self.spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta)

    def moe_blocks(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def new_state(self, dtype: torch.dtype, device: torch.device) -> SequenceState:
        return SequenceState([layer.mixer.new_state(dtype, device) for layer in self.model.layers])

    def forward(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """ids [T] -> final hidden states [T, H]; appends to `state`."""
        x = self.model.embed_tokens(ids)
        positions = torch.arange(state.length, state.length + ids.shape[0], device=ids.device)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer, layer_state in zip(self.model.layers, state.layers):
            x = layer(x, rope, layer_state)
        state.length += ids.shape[0]
        state.tokens.extend(ids.tolist())
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
