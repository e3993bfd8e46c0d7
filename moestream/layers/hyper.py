"""Hyper-connections (qwen4_exp): the residual is `hc_count` parallel streams instead of one.

Around each block, a `HyperConnection` reads the streams [T, hc * H], mixes them into the block's input
[T, H] with low-rank learned per-feature gates, and hands back per-stream weights with which the block's
output is added to every stream. That injection is left pending and done in the launch of the next
hyper-connection's stream norm (`RMSNorm.after_inject`), as the one-stream backbone adds in its next norm. The
final mixer (no injection) turns the streams into the hidden state that feeds the LM head. The block norms of
other models are replaced by the stream norm here.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.kernels import ops
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
        # what the normed streams feed: the low-rank mix and, around a block, the injection weights
        self.from_normed = Projections(self.input_mix_weight_down, *([self.block_inject_weight] if inject else []))

    def fuse_projections(self) -> None:
        self.from_normed.fuse()

    def forward(self, streams: torch.Tensor, out: torch.Tensor | None = None, weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """streams [T, hc * H], with the last block's output out [T, H] not yet injected at its weights [T, hc] (or
        None) -> (the streams after that injection, the block input [T, H], this block's injection weights [T, hc]
        or None). A decode token's is three launches on the GPU: injection + norm, the GEMV, the mix."""
        streams, normed = self.hc_norm.after_inject(streams, out, weights)
        mixed, weights = ops.hyper_mix(normed, self.from_normed(normed), self.input_mix_weight_up.weight, self.streams)
        return streams, mixed, weights
