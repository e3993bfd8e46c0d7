"""The multi-token-prediction head of Qwen3-Next-layout checkpoints (`mtp.*`), the drafter for speculative
decoding: from the trunk's final (post-norm) hidden state at t and the token x[t+1], a guess at x[t+2].

    x = fc(concat(norm_e(embed(x[t+1])), norm_h(h[t])))   # [H, 2H], embedding first
    h' = norm(one full-attention decoder layer(x))          # its own router, experts and KV cache
    logits = lm_head(h')                                    # the trunk's embedding and head, shared

The layer sits at position t for the pair (x[t+1], h[t]). Oracle: `training/model.py`'s MTP, in transformers'
layers (tests/models/test_mtp.py)."""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.context import StepContext
from moestream.layers.linear import Linear
from moestream.layers.norm import RMSNorm
from moestream.models.base import DecoderLayer, ModelSpec, SequenceState


class MTPHead(nn.Module):
    marker = "mtp.fc.weight"  # the tensor that says a checkpoint's `mtp.*` head is in this layout

    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        h, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        self.fc = Linear(2 * h, h, bias=False)
        # its experts: the record layer after the trunk's
        self.layers = nn.ModuleList([DecoderLayer(cfg, spec, 0, len(cfg.moe_layer_ids), kind="full_attention")])
        self.norm = RMSNorm(h, eps, zc)

    def new_state(self, dtype: torch.dtype, device: torch.device):
        return SequenceState([self.layers[0].new_state(dtype, device)])

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, next_ids: torch.Tensor, rope, state,
                ctx: StepContext) -> torch.Tensor:
        """hidden [T, H] (the trunk's output at t), next_embeds [T, H] (embed(x[t+1] = next_ids)) -> [T, H] for the
        lm_head; writes the layer's cache at ctx.positions into `state`."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        residual = self.layers[0]((x, None), next_ids, rope, state.layers[0], ctx)
        return self.norm.after(*residual)[1]

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        return out  # normed already


def head_class(model: nn.Module) -> type:
    """The module of `model`'s MTP head: its own (`mtp_head`), else Qwen3-Next's layout."""
    return model.mtp_head or MTPHead
