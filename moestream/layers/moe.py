"""The sparse MoE block: route, ask the expert provider where the step's records are (one call: the parts the
kernels compute), then combine every token's top-k outputs in k order (so nothing depends on residency)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.kernels import ops
from moestream.layers.context import StepContext
from moestream.layers.linear import Linear, Projections
from moestream.layers.mlp import MLP


class MoEOutput(NamedTuple):
    """A block's output before its combine: the next norm adds it to the residual stream in its own launch."""

    y: torch.Tensor  # [T, K, H] unweighted top-k outputs
    weights: torch.Tensor  # [T, K]
    shared: torch.Tensor | None = None  # the shared expert's output [T, H], and its gate [T, 1]
    shared_gate: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        return ops.moe_combine(*self)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_slot: int, shared_expert: bool):
        super().__init__()
        self.layer_slot, self.top_k, self.normalise = layer_slot, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if shared_expert:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.has_shared = shared_expert
        # every product of the block's input in one: the router's logits and the shared expert's gate and up rows
        self.from_input = Projections(self.gate, *((self.shared_expert.gate_proj, self.shared_expert.up_proj,
                                                     self.shared_expert_gate) if shared_expert else ()))
        self.provider = None  # set by the engine: the one seam to the expert subsystem

    def fuse_projections(self) -> None:
        self.from_input.fuse()

    def forward(self, x: torch.Tensor, ctx: StepContext, deferred: bool = False) -> torch.Tensor | MoEOutput:
        """x [T, H] -> [T, H], or with `deferred` its MoEOutput. The routers' ids land in `ctx.experts.routed` when
        the step counts them later."""
        t, h = x.shape
        routed = ctx.experts.routed
        weights, ids, *shared = self.from_input.routed(x, self.top_k, self.normalise,
                                                       routed[self.layer_slot] if routed is not None else None)
        if ctx.experts.cut is not None:  # a step in pieces: the host's turn between routing and experts
            ctx.experts.cut(self.layer_slot, x)
        # a padded prompt's extra rows are computed by no expert: zeros, so that every row stays finite
        y = x.new_empty(t * self.top_k, h) if ctx.experts.padding is None else x.new_zeros(t * self.top_k, h)
        for part in self.provider.parts(self.layer_slot, ids, x, ctx.experts):
            ops.expert_part(x, part, self.top_k, y)
        out = MoEOutput(y.view(t, self.top_k, h), weights)
        if self.has_shared:
            gate, up, shared_gate = shared
            out = out._replace(shared=self.shared_expert.down(gate, up), shared_gate=shared_gate)
        return out if deferred else out.value()
