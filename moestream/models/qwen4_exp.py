"""qwen4_exp (Qwen3.8-Flash-Next, text model): qwen3_5_moe's Gated DeltaNet and gated attention, with

- hyper-connections: the residual is `hc_count` streams [T, hc * H]; each block reads a learned mix of
  them and writes back to each with its own weight (layers/hyper.py); they replace the block norms and
  the final norm,
- PLE hashed n-gram embeddings added to the streams before some DeltaNet layers (layers/ple.py),
- QSA indexed sparse attention on the attention layers when the indexer fields are set (layers/qsa.py).

Every norm is zero-centred `(1 + w)` except the DeltaNet output norm, whose gate is `output_gate_type`.
A PLE layer's state is a `PLELayerState` (mixer state + PLE state); other layers keep their mixer's. The
per-layer loop is `CausalLM.forward`'s; the backbone carries the streams with the last block's output and
its injection weights pending, which the next stream norm (hyper-connection, PLE or final mixer) injects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.attention import Attention
from moestream.layers.context import StepContext
from moestream.layers.deltanet import DeltaNetState, GatedDeltaNet
from moestream.layers.hyper import HyperConnection
from moestream.layers.moe import SparseMoE
from moestream.layers.ple import PLE, PLEState
from moestream.layers.qsa import IndexedAttention
from moestream.models.base import CausalLM, ModelSpec


@dataclass
class PLELayerState:
    mixer: DeltaNetState
    ple: PLEState
    eos: int  # what the n-gram context reads before the first token

    def snapshot(self) -> PLELayerState:
        return PLELayerState(self.mixer.snapshot(), self.ple.snapshot(), self.eos)

    def load(self, other: PLELayerState) -> None:
        self.mixer.load(other.mixer)
        self.ple.load(other.ple)

    def reserve_rows(self, rows: int) -> None:
        self.mixer.reserve_rows(rows)
        self.ple.reserve_rows(rows)

    def rewind(self, row: int) -> None:
        self.mixer.rewind(row)
        self.ple.rewind(row)

    def advance(self, rows: int) -> None:
        self.mixer.advance(rows)  # the PLE state moves on in the forward, in place

    def reset(self) -> None:
        self.mixer.reset()
        self.ple.reset(self.eos)


class HyperDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, layer_slot: int):
        super().__init__()
        self.kind = cfg.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, fused_qkvz=False, gate_activation=cfg.output_gate_type)
        elif self.kind == "indexed_attention":
            self.self_attn = IndexedAttention(cfg)
        else:
            self.self_attn = Attention(cfg, qk_norm=True, output_gate=True, zero_centered=True)
        self.mlp = SparseMoE(cfg, layer_slot, shared_expert=True)
        self.ple = PLE(cfg, index) if index in cfg.ple_layer_ids else None
        self.attn_hyper_connection = HyperConnection(cfg)
        self.mlp_hyper_connection = HyperConnection(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def new_state(self, dtype: torch.dtype, device: torch.device):
        state = self.mixer.new_state(dtype, device)
        if self.ple is None:
            return state
        return PLELayerState(state, self.ple.new_state(dtype, device), self.ple.ple_embedding.eos)

    def forward(self, residual: tuple, ids: torch.Tensor, rope, state, ctx: StepContext) -> tuple:
        """residual (streams [T, hc * H], the last block's output [T, H] and its injection weights [T, hc] not yet
        injected, or None, None), ids [T] -> the same after this layer; each injection runs in the launch of the
        stream norm after it."""
        if self.ple is not None:
            residual = self.ple(residual, ids, state.ple, ctx.static), None, None
            state = state.mixer
        streams, x, weights = self.attn_hyper_connection(*residual)
        mixer = self.linear_attn(x, state, ctx) if self.kind == "linear_attention" else None
        out = mixer if mixer is not None else self.self_attn(x, rope, state, ctx)
        streams, x, weights = self.mlp_hyper_connection(streams, out, weights)
        return streams, self.mlp(x, ctx), weights


class HyperBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # every layer is MoE (config.py refuses dense layers), so the record slot is the layer index
        self.layers = nn.ModuleList(HyperDecoderLayer(cfg, i, i) for i in range(cfg.num_hidden_layers))
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)
        self.streams = cfg.hc_count

    def begin(self, x: torch.Tensor) -> tuple:
        return x.repeat(1, self.streams), None, None  # every stream starts as the embedding

    def end(self, residual: tuple) -> torch.Tensor:
        return self.hyper_connection_mixer(*residual)[1]


class Model(CausalLM):
    spec = ModelSpec(zero_centered_norms=True, attention_output_gate=True, shared_expert=True)
    backbone_class = HyperBackbone
    mtp_layout = False  # its MTP head (cherenkov.md §1.1) is not built yet; mtp.* stays in the store
