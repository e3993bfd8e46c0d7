"""Decode steps on CUDA with static shapes.

Every decode step on CUDA runs the same kernels: attention over the whole (fixed) KV buffer with a
mask, DeltaNet state updated in place, experts one tile per routing entry. When every expert record is
addressable without a host decision (all in the GPU pool, or the rest in the pinned host tier, read in
place over PCIe) the step is one CUDA graph; otherwise it runs eagerly, with the routing handshake per
layer. Both give the same bits, so the output does not depend on what was resident.
"""

from __future__ import annotations

import torch

from moestream.layers.attention import decode_attention
from moestream.layers.hyper import HyperConnection
from moestream.layers.moe import SparseMoE
from moestream.models.base import CausalLM, SequenceState

STATIC_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp")


def supports_static_decode(model: CausalLM) -> bool:
    """qwen4_exp only without PLE layers (their rows are read on the host per token) and without indexed
    attention (its block selection has no static form yet)."""
    cfg = model.config
    if cfg.model_type == "qwen4_exp":
        return not cfg.ple_layer_ids and "indexed_attention" not in cfg.layer_types
    return cfg.model_type in STATIC_TYPES


def static_step(model: CausalLM, token: torch.Tensor, position: torch.Tensor, state: SequenceState,
                addresses: torch.Tensor | None, routed: torch.Tensor | None = None) -> torch.Tensor:
    """token, position: [1] device tensors -> logits [1, vocab]; writes the caches at `position`, and with
    `addresses` each MoE layer's expert ids into `routed` [num_moe_layers, top_k]. With hyper-connections
    (qwen4_exp) the residual is the streams and the hyper-connections stand where the norms do; otherwise
    each residual add runs in the launch of the norm after it."""
    x = model.model.embed_tokens(token)
    rope = model.rotary.cos_sin(position, x.dtype)
    hyper = model.config.model_type == "qwen4_exp"
    streams = x.repeat(1, model.config.hc_count) if hyper else None
    pending = None  # the last block's output, not yet added to x
    for layer, layer_state in zip(model.model.layers, state.layers):
        if hyper:
            h, weights = layer.attn_hyper_connection(streams)
        else:
            x, h = layer.input_layernorm.after(x, pending)
        if layer.kind == "linear_attention":
            out = layer.linear_attn(h, layer_state)
        else:
            out = decode_attention(layer.self_attn, h, rope, position, layer_state)
        if hyper:
            streams = HyperConnection.inject(streams, out, weights)
            h, weights = layer.mlp_hyper_connection(streams)
        else:
            x, h = layer.post_attention_layernorm.after(x, out)
        if isinstance(layer.mlp, SparseMoE):
            slot = layer.mlp.layer_slot
            table = addresses[slot] if addresses is not None else None
            pending = layer.mlp(h, table, routed[slot] if routed is not None else None)
        else:
            pending = layer.mlp(h)
        if hyper:
            streams = HyperConnection.inject(streams, pending, weights)
    if hyper:
        return model.logits(model.model.hyper_connection_mixer(streams)[0])
    return model.logits(model.model.norm.after(x, pending)[1])


class CudaDecoder:
    """`mode`: "graph" (capture when every record is addressable), "addressed" (read records in place but
    run eagerly: to time graphs against), or "handshake" (always route through the host)."""

    def __init__(self, model: CausalLM, provider, max_context: int, mode: str = "graph"):
        self.model, self.provider, self.max_context, self.mode = model, provider, max_context, mode
        device = next(model.parameters()).device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.graph, self.graph_state, self.logits = None, None, None
        self.graph_replays = 0
        top_k = model.config.num_experts_per_tok
        self.routed = torch.zeros(len(model.moe_blocks()), top_k, dtype=torch.long, device=device)

    def prepare(self, state: SequenceState) -> None:
        for s in state.layers:
            if hasattr(s, "reserve"):
                s.reserve(self.max_context)

    @torch.inference_mode()
    def step(self, token: int, state: SequenceState) -> torch.Tensor:
        """Feed one token; returns the next logits [vocab] (float32)."""
        if state.length >= self.max_context:
            self.max_context *= 2
            self.graph = None
        self.prepare(state)
        self.token.fill_(token)
        self.position.fill_(state.length)
        addresses = self.provider.address_table() if self.mode != "handshake" else None
        if addresses is not None and self.graph is not None and self.graph_state is state:
            self.graph.replay()
            self.graph_replays += 1
            logits = self.logits
        else:
            logits = static_step(self.model, self.token, self.position, state, addresses, self.routed)
            if addresses is not None and self.mode == "graph":  # capture after one eager run (compiled, allocated)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = static_step(self.model, self.token, self.position, state, addresses, self.routed)
                self.graph_state = state
        if addresses is not None:  # the provider saw none of this step's lookups
            self.provider.count_addressed(self.routed)
        for s in state.layers:
            if hasattr(s, "length"):
                s.length += 1
        state.length += 1
        state.tokens.append(token)
        return logits[0].clone()  # a replay overwrites the graph's output buffer
