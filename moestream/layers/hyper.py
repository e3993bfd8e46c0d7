"""Hyper-connections (qwen4_exp): the residual is `hc_count` parallel streams instead of one.

Around each block, a `HyperConnection` reads the streams [T, hc * H], mixes them into the block's input
[T, H] with low-rank learned per-feature gates, and hands back per-stream weights with which the block's
output is added to every stream (`inject`). The final mixer (no injection) turns the streams into the
hidden state that feeds the LM head. The block norms of other models are replaced by the stream norm here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.linear import Linear, Projections
from moestream.layers.norm import RMSNorm


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig, inject: bool = True):
        super().__init__()
        self.streams, self.hidden = cfg.hc_count, cfg.hidden_size
        width = self.streams * self.hidden
        self.hc_norm = RMSNorm(width, cfg.rms_norm_eps, zero_centered=True, group_size=self.hidden)
        self.input_mix_weight_down = Linear(width, cfg.hc_lowrank, bias=False)
        self.input_mix_weight_up = Linear(cfg.hc_lowrank, width, bias=False)
        if inject:
            self.block_inject_weight = Linear(width, self.streams, bias=False)
        self.has_inject = inject
        # what the normed streams feed: the low-rank mix and, around a block, the injection weights
        self.from_normed = Projections(self.input_mix_weight_down, *([self.block_inject_weight] if inject else []))

    def fuse_projections(self) -> None:
        self.from_normed.fuse()

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, hc * H] -> (block input [T, H], injection weights [T, hc] or None)."""
        normed = self.hc_norm(streams)
        low, *inject = self.from_normed.parts(normed)
        low = F.silu(low / self.streams)
        gates = torch.sigmoid(self.input_mix_weight_up(low)).unflatten(-1, (self.streams, self.hidden))
        mixed = (gates * normed.unflatten(-1, (self.streams, self.hidden))).mean(dim=-2)
        if not self.has_inject:
            return mixed, None
        return mixed, 2 * torch.sigmoid(inject[0] / self.streams)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [T, hc * H] + block output [T, H] scaled per stream by weights [T, hc]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
