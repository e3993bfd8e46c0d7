"""Launching the Triton RMSNorm."""

from __future__ import annotations

import torch
import triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    from moestream.kernels.triton.norm import rms_norm_kernel

    d = x.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    rms_norm_kernel[(x.numel() // d,)](x, weight, out, eps, D=d, BLOCK=triton.next_power_of_2(d),
                                      ZERO_CENTERED=zero_centered, num_warps=4 if d >= 1024 else 1)
    return out
