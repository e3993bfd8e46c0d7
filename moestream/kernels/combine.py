"""Launching the MoE combine kernel (reference.moe_combine)."""

from __future__ import annotations

import torch

BLOCK = 1024  # columns a program: the flagship's 2560 in three programs a token


def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                shared_gate: torch.Tensor | None) -> torch.Tensor:
    """y [T, K, H] unweighted expert outputs, weights [T, K] -> [T, H] (+ sigmoid(shared_gate [T, 1]) * shared)."""
    from moestream.kernels.triton.combine import combine_kernel

    t, k, h = y.shape
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    has_shared = shared is not None
    combine_kernel[(t, -(-h // BLOCK))](y.contiguous(), weights.contiguous(),
                                        shared.contiguous() if has_shared else y,
                                        shared_gate.contiguous() if has_shared else y, out, H=h, TOP_K=k,
                                        BLOCK=BLOCK, SHARED=has_shared, num_warps=4)
    return out
