"""Launching the row-wise Triton kernels: RMSNorm, the rotary embedding and MoE routing."""

from __future__ import annotations

import torch
import triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    from moestream.kernels.triton.rowwise import rms_norm_kernel

    d = x.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    rms_norm_kernel[(x.numel() // d,)](x, weight, out, eps, D=d, BLOCK=triton.next_power_of_2(d),
                                      ZERO_CENTERED=zero_centered, num_warps=4 if d >= 1024 else 1)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim] in x's dtype."""
    from moestream.kernels.triton.rowwise import rotary_kernel

    t, heads, d = x.shape
    rot = cos.shape[-1]
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotary_kernel[(t, heads)](x, cos.contiguous(), sin.contiguous(), out, HEADS=heads, D=d, ROT=rot,
                              HALF_BLOCK=triton.next_power_of_2(rot // 2),
                              REST_BLOCK=triton.next_power_of_2(max(d - rot, 1)), num_warps=1)
    return out


def route(logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype):
    """logits [T, E] -> (weights [T, top_k] in `dtype`, expert ids [T, top_k] int64)."""
    from moestream.kernels.triton.rowwise import route_kernel

    t, experts = logits.shape
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    route_kernel[(t,)](logits.contiguous(), weights, ids, E=experts, BLOCK=triton.next_power_of_2(experts),
                       TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k), NORMALISE=normalise,
                       num_warps=4 if experts >= 256 else 1)
    return weights, ids
