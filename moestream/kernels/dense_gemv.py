"""Launching the dense GEMV: a decode token's attention projections and router, one launch each (cuBLAS ran
the [q|k|v] projection as a split-K GEMM plus a reduction kernel, at about half the HBM rate)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

BK = 512  # K chunk: four 16-byte loads a thread at 4 warps and BN 8
BN = 8
MIN_PROGRAMS = 1024  # enough blocks that every SM keeps several in flight
MIN_SPAN = 2 * BK  # columns of a split of K: each program still streams a few chunks
SUM_BLOCK = 1024


def plan(n: int, k: int) -> tuple[int, int]:
    """(rows a block, splits of K): K split in powers of two while the blocks are too few to fill the GPU and the
    spans stay long (a 324 x 10240 weight: 41 blocks a whole K each ran at ~300 GB/s), then fewer rows a block."""
    bn, splits = BN, 1
    while -(-n // bn) * splits < MIN_PROGRAMS and k // (2 * splits) >= MIN_SPAN:
        splits *= 2
    while bn > 1 and -(-n // bn) * splits < MIN_PROGRAMS:
        bn //= 2
    return bn, splits


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               up: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] -> [1, N] = x @ weight.T (+ bias); weight [N, K] contiguous. With `up` [1, K], the input is
    silu(x) * up instead (the down projection of a SwiGLU MLP, its gate and up products never stored)."""
    from moestream.kernels.triton.dense_gemv import dense_gemv_kernel, split_sum_kernel

    n, k = weight.shape
    bn, splits = plan(n, k)
    span = -(-k // (splits * 64)) * 64  # whole 128-byte lines a split
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    x = x.contiguous()
    bias_or_any = weight if bias is None else bias
    dense_gemv_kernel[(-(-n // bn), splits)](x, x if up is None else up.contiguous(), weight, bias_or_any, y, part, n,
                                            K=k, BN=bn, BK=min(BK, triton.next_power_of_2(k)), SPAN=span,
                                            SPLITS=splits, HAS_BIAS=bias is not None, GLU=up is not None,
                                            num_warps=4)
    if splits > 1:
        split_sum_kernel[(-(-n // SUM_BLOCK),)](part, bias_or_any, y, n, SPLITS=splits, BLOCK=SUM_BLOCK,
                                                HAS_BIAS=bias is not None, num_warps=4)
    return y


ROWS = 16  # token rows a launch pads to: the MMA's smallest width, and the largest decode batch


@dataclass(frozen=True)
class RowsTile:
    bn: int = 16
    bk: int = 256
    warps: int = 4
    stages: int = 3
    min_programs: int = MIN_PROGRAMS


def rows_plan(n: int, k: int, tile: RowsTile) -> int:
    """Splits of K (powers of two) while the blocks are too few and the spans stay two chunks long."""
    splits = 1
    while -(-n // tile.bn) * splits < tile.min_programs and k // (2 * splits) >= 2 * tile.bk:
        splits *= 2
    return splits


def dense_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, up: torch.Tensor | None = None,
               tile: RowsTile = RowsTile()) -> torch.Tensor:
    """x [T, K] (T <= ROWS; rows of any stride) -> [T, N] = x @ weight.T (+ bias), each row's bits independent of T;
    with `up` (same shape and stride as x), the input is silu(x) * up."""
    from moestream.kernels.triton.dense_gemv import dense_rows_kernel, split_sum_kernel

    t, k = x.shape
    n = weight.shape[0]
    assert t <= ROWS and x.stride(1) == 1 and (up is None or up.stride() == x.stride())
    splits = rows_plan(n, k, tile)
    span = -(-k // (splits * 64)) * 64
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    bias_or_any = weight if bias is None else bias
    dense_rows_kernel[(-(-n // tile.bn), splits)](
        x, x if up is None else up, weight, bias_or_any, y, part, t, n, x.stride(0), K=k, BN=tile.bn,
        BK=min(tile.bk, triton.next_power_of_2(k)), SPAN=span, SPLITS=splits, ROWS=ROWS, HAS_BIAS=bias is not None,
        GLU=up is not None, IEEE=x.dtype == torch.float32, num_warps=tile.warps, num_stages=tile.stages)
    if splits > 1:
        split_sum_kernel[(-(-t * n // SUM_BLOCK),)](part, bias_or_any, y, t * n, SPLITS=splits, BLOCK=SUM_BLOCK,
                                                    HAS_BIAS=False, num_warps=4)
        if bias is not None:
            y += bias
    return y
