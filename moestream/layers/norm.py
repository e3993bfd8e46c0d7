"""RMSNorm variants: plain `w * norm(x)`, zero-centred `(1 + w) * norm(x)`, grouped (each `group_size`
slice of the last dim normalised on its own: the hyper-connection streams of qwen4_exp, which a block's output
is injected into in the norm's launch), and gated."""

from __future__ import annotations

import torch
from torch import nn

from moestream.kernels import ops
from moestream.kernels.reference import gated_rms_norm
from moestream.layers.moe import MoEOutput


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.zero_centered, self.group_size = eps, zero_centered, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:  # one kernel on the GPU (decode runs four per layer)
            return ops.rms_norm(x, self.weight, self.eps, self.zero_centered)
        return ops.grouped_rms_norm(x, self.weight, self.eps, self.zero_centered, self.group_size)

    def after(self, x: torch.Tensor, residual: torch.Tensor | MoEOutput | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm) in one launch on the GPU (an MoE block's combine too); (x, norm(x)) when there
        is no residual."""
        if isinstance(residual, MoEOutput):
            if self.group_size is None:
                return ops.combine_add_rms_norm(x, *residual, self.weight, self.eps, self.zero_centered)
            residual = residual.value()
        if residual is None or self.group_size is not None:
            x = x if residual is None else x + residual
            return x, self(x)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)

    def after_inject(self, streams: torch.Tensor, out: torch.Tensor | None, weights: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped: (streams [T, groups * g] + out [T, g] added to group s at weights[:, s] ([T, groups]), its norm)
        in one launch on the GPU; (streams, norm(streams)) when there is no out."""
        if out is None:
            return streams, self(streams)
        return ops.inject_rms_norm(streams, out, weights, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """`w * norm(x) * act(gate)`, the DeltaNet output norm (silu gate, or sigmoid in qwen4_exp)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.activation = eps, activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, self.activation)
