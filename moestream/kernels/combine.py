"""Launching the MoE combine kernel (reference.moe_combine), alone or inside the next add + RMSNorm."""

from __future__ import annotations

import torch
import triton

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


def combine_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                         shared_gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rowwise.add_rms_norm(x, moe_combine(y, weights, shared, shared_gate), ...) in one launch, a program a row
    (as many warps as rms_norm_kernel takes, so the norm sums in its order)."""
    from moestream.kernels.triton.rowwise import combine_add_rms_norm_kernel

    t, k, h = y.shape
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    total = torch.empty_like(x)
    has_shared = shared is not None
    combine_add_rms_norm_kernel[(t,)](x, y.contiguous(), weights.contiguous(),
                                      shared.contiguous() if has_shared else y,
                                      shared_gate.contiguous() if has_shared else y, total, weight, out, eps, D=h,
                                      BLOCK=triton.next_power_of_2(h), TOP_K=k, SHARED=has_shared,
                                      ZERO_CENTERED=zero_centered, num_warps=4 if h >= 1024 else 1)
    return total, out
