"""qwen4_exp (Qwen3.8-Flash-Next, text model): qwen3_5_moe's Gated DeltaNet and gated attention, with

- hyper-connections: the residual is `hc_count` streams [T, hc * H]; each block reads a learned mix of
  them and writes back to each with its own weight (layers/hyper.py); they replace the block norms and
  the final norm,
- PLE hashed n-gram embeddings added to the streams before some DeltaNet layers (layers/ple.py),
- QSA indexed sparse attention on the attention layers when the indexer fields are set (layers/qsa.py),
- an MTP head of its own layout (`HyperMTPHead`).

Every norm is zero-centred `(1 + w)` except the DeltaNet output norm, whose gate is `output_gate_type`.
A PLE layer's state is a `PLELayerState` (mixer state + PLE state); other layers keep their mixer's. The
per-layer loop is `CausalLM.forward`'s; the backbone carries the streams with the last block's output and
its injection weights pending, which the next stream norm (hyper-connection, PLE or final mixer) injects. The
trunk's output is its streams (what the MTP head reads); its final mixer runs before the LM head (`head_input`).
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
from moestream.layers.linear import Linear
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.ple import PLE, PLEState
from moestream.layers.qsa import IndexedAttention
from moestream.models.base import CausalLM, ModelSpec, SequenceState


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
    def __init__(self, cfg: ModelConfig, kind: str, layer_slot: int, ple_index: int | None = None):
        super().__init__()
        self.kind = kind
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, fused_qkvz=False, gate_activation=cfg.output_gate_type)
        elif self.kind == "indexed_attention":
            self.self_attn = IndexedAttention(cfg)
        else:
            self.self_attn = Attention(cfg, qk_norm=True, output_gate=True, zero_centered=True)
        self.mlp = SparseMoE(cfg, layer_slot, shared_expert=True)
        self.ple = PLE(cfg, ple_index) if ple_index is not None else None
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


class StreamsOut:
    """A stack whose output is its hyper-connection streams (what an MTP head reads), mixed into one hidden state by
    its `hyper_connection_mixer` only for the LM head."""

    def end(self, residual: tuple) -> torch.Tensor:
        return self.hyper_connection_mixer.hc_norm.after_inject(*residual)[0]  # the streams [T, hc * H]

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        return self.hyper_connection_mixer(streams)[1]


class HyperBackbone(StreamsOut, nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # every layer is MoE (config.py refuses dense layers), so the record slot is the layer index
        self.layers = nn.ModuleList(HyperDecoderLayer(cfg, kind, i, i if i in cfg.ple_layer_ids else None)
                                    for i, kind in enumerate(cfg.layer_types))
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)
        self.streams = cfg.hc_count

    def begin(self, x: torch.Tensor) -> tuple:
        return x.repeat(1, self.streams), None, None  # every stream starts as the embedding


class HyperMTPHead(StreamsOut, nn.Module):
    """qwen4_exp's MTP head (cherenkov.md §1.1; transformers skips `mtp.*`): from the trunk's streams s[t] and the
    token x[t+1], a guess at x[t+2].

        e = fc_embedding(norm_e(embed(x[t+1])))                    # [H]
        streams_g = fc_hidden(norm_h(s[t])_g) + e                  # norm_h over all hc * H at once, one fc for each g
        then one attention + MoE block with hyper-connections       # its own experts, KV and indexer keys
        logits = lm_head(its own mixer(streams))                    # the trunk's LM head, shared
    """

    marker = "mtp.fc_hidden.weight"

    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        h, self.streams = cfg.hidden_size, cfg.hc_count
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(h * self.streams, cfg.rms_norm_eps, zero_centered=True)
        self.fc_embedding = Linear(h, h, bias=False)
        self.fc_hidden = Linear(h, h, bias=False)
        attention = next(kind for kind in cfg.layer_types if kind != "linear_attention")  # the trunk's kind
        self.layers = nn.ModuleList([HyperDecoderLayer(cfg, attention, len(cfg.moe_layer_ids))])  # experts: next slot
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> SequenceState:
        return SequenceState([self.layers[0].new_state(dtype, device)])

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, next_ids: torch.Tensor, rope, state,
                ctx: StepContext) -> torch.Tensor:
        """hidden [T, hc * H] (the trunk's streams at t), next_embeds [T, H] (embed(x[t+1])) -> the head's streams
        [T, hc * H]; writes the layer's caches at ctx.positions into `state`."""
        rows = hidden.shape[0]
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        normed = self.pre_fc_norm_hidden(hidden).view(rows * self.streams, -1)
        streams = (self.fc_hidden(normed).view(rows, self.streams, -1) + embedded[:, None]).flatten(1)
        return self.end(self.layers[0]((streams, None, None), next_ids, rope, state.layers[0], ctx))


class Model(CausalLM):
    spec = ModelSpec(zero_centered_norms=True, attention_output_gate=True, shared_expert=True)
    backbone_class = HyperBackbone
    mtp_head = HyperMTPHead
