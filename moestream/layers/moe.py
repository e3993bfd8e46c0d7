"""The sparse MoE block: route, ask the expert provider for batches of resident experts, compute each
batch, then combine every token's top-k outputs in k order (so nothing depends on residency)."""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.kernels import ops
from moestream.layers.mlp import MLP


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_slot: int, shared_expert: bool):
        super().__init__()
        self.layer_slot, self.top_k, self.normalise = layer_slot, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if shared_expert:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.has_shared = shared_expert
        self.provider = None  # set by the engine: the one seam to the expert subsystem

    def forward(self, x: torch.Tensor, addresses: torch.Tensor | None = None,
                routed: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. With `addresses` ([num_experts] int64 record addresses on the device) the
        experts are read in place with no host decision (a CUDA-graph decode step), and the routing writes their
        ids to `routed` [T * top_k] for the counters; else through the provider's batches."""
        t, h = x.shape
        weights, ids = ops.route(ops.linear(x, self.gate.weight), self.top_k, self.normalise, x.dtype,
                                 routed if addresses is not None else None)
        y = x.new_empty(t * self.top_k, h)
        if addresses is not None:
            ops.expert_entries(x, addresses, ids.reshape(-1), self.provider.layout, self.top_k, y,
                               self.provider.addressed_low_bit(self.layer_slot))
        elif (table := self.provider.in_place_table(self.layer_slot, t)) is not None:
            counts = ops.expert_group_in_place(x, table, ids, self.provider.layout, self.top_k, y)
            self.provider.count_in_place(self.layer_slot, counts)
        else:
            for b in self.provider.batches(self.layer_slot, ids, x):
                ops.expert_group(x, b.buffer, b.slots, b.layout, b.spans, b.order, self.top_k, y)
        out = ops.combine_topk(y.view(t, self.top_k, h), weights)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
