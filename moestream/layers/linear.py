"""Linear layers for the decode path: one token's product runs the Triton GEMV (`ops.linear`), and projections
that read the same input become row slices of one weight at load (`Projections.fuse`), so they are one launch.
Each keeps its checkpoint name and loads as usual; only the storage is shared."""

from __future__ import annotations

import torch
from torch import nn

from moestream.kernels import ops


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class Projections:
    """Linears over one input, computed as one product once fused; before that (a module not loaded through a
    store), one by one."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [p.out_features for p in linears]
        self.weight = self.bias = None

    @torch.no_grad()  # with autograd on, the fused weight's graph would hold the unfused copies for good
    def fuse(self) -> None:
        """One weight (and bias) whose row slices become the linears' own parameters."""
        with_bias = self.linears[0].bias is not None
        for name in ("weight", "bias") if with_bias else ("weight",):
            fused = torch.cat([getattr(p, name) for p in self.linears])
            for p, part in zip(self.linears, fused.split(self.sizes)):
                setattr(p, name, nn.Parameter(part, requires_grad=False))
            setattr(self, name, fused)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> the linears' outputs side by side [T, sum of out_features]."""
        if self.weight is None:
            return torch.cat([ops.linear(x, p.weight, p.bias) for p in self.linears], dim=-1)
        return ops.linear(x, self.weight, self.bias)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, K] -> each linear's output [T, out_features] (views of one product)."""
        return self(x).split(self.sizes, dim=-1)

    def routed(self, x: torch.Tensor, top_k: int, normalise: bool, ids_out: torch.Tensor | None = None) -> tuple:
        """The first linear is a router: (weights [T, top_k], ids [T, top_k], then every linear's output), the
        routing in the product's launch on the GPU (ops.routed_linear)."""
        if self.weight is None:
            logits, *rest = self.parts(x)
            return (*ops.route(logits, top_k, normalise, x.dtype, ids_out), *rest)
        y, weights, ids = ops.routed_linear(x, self.weight, self.bias, self.sizes[0], top_k, normalise, ids_out)
        return (weights, ids, *y.split(self.sizes, dim=-1)[1:])
