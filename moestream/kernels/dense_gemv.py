"""Launching the dense GEMV: a decode token's attention projections and router, one launch each (cuBLAS ran
the [q|k|v] projection as a split-K GEMM plus a reduction kernel, at about half the HBM rate)."""

from __future__ import annotations

import torch
import triton

BK = 512  # K chunk: four 16-byte loads a thread at 4 warps and BN 8
MIN_PROGRAMS = 1024  # enough blocks that every SM keeps several in flight


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               up: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] -> [1, N] = x @ weight.T (+ bias); weight [N, K] contiguous. With `up` [1, K], the input is
    silu(x) * up instead (the down projection of a SwiGLU MLP, its gate and up products never stored)."""
    from moestream.kernels.triton.dense_gemv import dense_gemv_kernel

    n, k = weight.shape
    bn = 8
    while bn > 1 and n // bn < MIN_PROGRAMS:  # small N: fewer rows a block, so that the blocks fill the GPU
        bn //= 2
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    dense_gemv_kernel[(-(-n // bn),)](x, x if up is None else up.contiguous(), weight,
                                     weight if bias is None else bias, y, n, K=k, BN=bn,
                                     BK=min(BK, 1 << (k - 1).bit_length()), HAS_BIAS=bias is not None,
                                     GLU=up is not None, num_warps=4)
    return y


ROWS = 16  # token rows a launch pads to: the MMA's smallest width, and the largest decode batch
ROWS_BN, ROWS_BK = 16, 256


def dense_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               up: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (T <= ROWS; rows of any stride) -> [T, N] = x @ weight.T (+ bias), each row's bits independent of T;
    with `up` (same shape and stride as x), the input is silu(x) * up."""
    from moestream.kernels.triton.dense_gemv import dense_rows_kernel

    t, k = x.shape
    n = weight.shape[0]
    assert t <= ROWS and x.stride(1) == 1 and (up is None or up.stride() == x.stride())
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    dense_rows_kernel[(-(-n // ROWS_BN),)](x, x if up is None else up, weight, weight if bias is None else bias, y, t,
                                           n, x.stride(0), K=k, BN=ROWS_BN, BK=min(ROWS_BK, triton.next_power_of_2(k)),
                                           ROWS=ROWS, HAS_BIAS=bias is not None, GLU=up is not None,
                                           IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3)
    return y
