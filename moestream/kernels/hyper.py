"""Launching the hyper-connection kernels (qwen4_exp): a decode token's hyper-connection is the injection with the
grouped norm, the [down | inject] GEMV (dense_gemv) and the mix, three launches instead of ~22 in aten."""

from __future__ import annotations

import torch
import triton

# H columns a mix program owns and its low-rank chunk: 640 programs of 3 chunks on the flagship (H = 2560, rank 320),
# 4.7 us a launch on an H100 against 7.1 at 8 columns x 5 chunks of 64 (the loads in flight, not the programs, count)
MIX_COLUMNS = 4
MIX_K = 128


def inject_rms_norm(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.inject_rms_norm in one launch: streams [T, hc * H], out [T, H], weights [T, hc], all one dtype."""
    from moestream.kernels.triton.hyper import inject_rms_norm_kernel

    t, h = out.shape
    streams, out, weights = streams.contiguous(), out.contiguous(), weights.contiguous()
    new = torch.empty_like(streams)
    normed = torch.empty(streams.shape, device=streams.device, dtype=streams.dtype if zero_centered else
                         torch.promote_types(streams.dtype, norm_weight.dtype))
    inject_rms_norm_kernel[(streams.numel() // h,)](streams, out, weights, new, norm_weight, normed, eps,
                                                    HC=weights.shape[-1], D=h, BLOCK=triton.next_power_of_2(h),
                                                    ZERO_CENTERED=zero_centered, num_warps=4 if h >= 1024 else 1)
    return new, normed


def hyper_mix(normed: torch.Tensor, projected: torch.Tensor, up_weight: torch.Tensor,
              streams: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """reference.hyper_mix in one launch: normed [T, hc * H], projected [T, lowrank (+ hc)] (rows contiguous),
    up_weight [hc * H, lowrank] contiguous."""
    from moestream.kernels.triton.hyper import hyper_mix_kernel

    t, width = normed.shape
    h, lowrank = width // streams, up_weight.shape[1]
    inject = projected.shape[-1] > lowrank
    normed = normed.contiguous()
    if projected.stride(-1) != 1:
        projected = projected.contiguous()
    mixed = torch.empty(t, h, dtype=normed.dtype, device=normed.device)
    weights = torch.empty(t, streams, dtype=projected.dtype, device=normed.device) if inject else None
    hyper_mix_kernel[(t, triton.cdiv(h, MIX_COLUMNS))](
        normed, projected, up_weight, mixed, mixed if weights is None else weights, PROJ_STRIDE=projected.stride(0),
        HC=streams, H=h, R=lowrank, HC_BLOCK=triton.next_power_of_2(streams), BH=MIX_COLUMNS,
        BK=min(MIX_K, triton.next_power_of_2(lowrank)), INJECT=inject, num_warps=4)
    return mixed, weights
