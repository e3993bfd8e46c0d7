"""Launching the dense GEMV: a decode step's projections, one launch each (two where K is split), for up to
DECODE_MAX_ROWS token rows (cuBLAS ran the [q|k|v] projection as a split-K GEMM plus a reduction kernel, at about
half the HBM rate, and its tiles change with the number of rows)."""

from __future__ import annotations

import torch
import triton

BK = 512  # K chunk: four 16-byte loads a thread at 4 warps and BN 8
BN = 8
MIN_PROGRAMS = 1024  # enough blocks that every SM keeps several in flight
MIN_SPAN = 2 * BK  # columns of a split of K: each program still streams a few chunks
SUM_BLOCK = 1024
GROUP = 4  # token rows a program: each its own accumulator (more would spill)


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
    """x [T, K] (rows of any stride) -> [T, N] = x @ weight.T (+ bias); weight [N, K] contiguous. With `up` (x's
    shape and strides), the input is silu(x) * up instead (the down projection of a SwiGLU MLP, its gate and up
    products never stored). A row's bits are the same whatever T is: the tiles depend on the weight's shape only."""
    from moestream.kernels.triton.dense_gemv import dense_gemv_kernel, split_sum_kernel

    t, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or (up is not None and up.stride() != x.stride()):  # rows the kernel cannot stride over
        x, up = x.contiguous(), None if up is None else up.contiguous()
    bn, splits = plan(n, k)
    span = -(-k // (splits * 64)) * 64  # whole 128-byte lines a split
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    bias_or_any = weight if bias is None else bias
    group = min(GROUP, triton.next_power_of_2(t))
    dense_gemv_kernel[(-(-n // bn), splits, -(-t // group))](
        x, x if up is None else up, weight, bias_or_any, y, part, t, n, x.stride(0), K=k, BN=bn,
        BK=min(BK, triton.next_power_of_2(k)), SPAN=span, SPLITS=splits, GROUP=group, HAS_BIAS=bias is not None,
        GLU=up is not None, num_warps=4)
    if splits > 1:
        split_sum_kernel[(-(-t * n // SUM_BLOCK),)](part, bias_or_any, y, t * n, n, SPLITS=splits, BLOCK=SUM_BLOCK,
                                                    HAS_BIAS=bias is not None, num_warps=4)
    return y
