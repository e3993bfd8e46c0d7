"""Launching the dense decode kernel: a decode step's projections for up to DECODE_MAX_ROWS token rows, one launch
each, the weights read once for every row (cuBLAS ran the [q|k|v] projection as a split-K GEMM plus a reduction
kernel, at about half the HBM rate, and its tiles change with the number of rows; a GEMV with an accumulator per
row read the weights once per 4 rows: 16 rows cost 4-8x one)."""

from __future__ import annotations

import torch

from moestream.kernels.launch import arrival_counts

BK = 128  # K chunk: a [16, BK] x [BK, BN] tensor-core product
MIN_PROGRAMS = 528  # four blocks an SM of the H200's 132


def arrivals(weight: torch.Tensor) -> torch.Tensor:
    """The counts a split launch over `weight` keeps (launch.arrival_counts), one set a weight. Two streams never run
    split launches of one weight at once: prompts beside decoding steps run more rows than DECODE_MAX_ROWS."""
    return arrival_counts(("dense_gemv", weight.data_ptr()), MIN_PROGRAMS, weight.device)


def plan(n: int, k: int) -> tuple[int, int]:
    """(weight rows a block, splits of K): 64 rows (16 for a small N), K split in powers of two while the blocks are
    too few to fill the GPU and each split keeps a few chunks. The tiles depend on the weight's shape alone."""
    bn, splits = (64 if n >= 512 else 16), 1
    while -(-n // bn) * splits < MIN_PROGRAMS and k // (2 * splits) >= 2 * BK:
        splits *= 2
    return bn, splits


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               up: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (T <= 16, rows of any stride) -> [T, N] = x @ weight.T (+ bias); weight [N, K] contiguous. With `up`
    (x's shape and strides), the input is silu(x) * up instead (the down projection of a SwiGLU MLP, its gate and
    up products never stored). A row's bits are the same whatever T is: the tiles depend on the weight's shape
    only, and every launch computes 16 rows."""
    from moestream.kernels.triton.dense_gemv import dense_rows_kernel

    t, k = x.shape
    n = weight.shape[0]
    assert t <= 16
    if x.stride(1) != 1 or (up is not None and up.stride() != x.stride()):  # rows the kernel cannot stride over
        x, up = x.contiguous(), None if up is None else up.contiguous()
    bn, splits = plan(n, k)
    span = -(-k // (splits * BK)) * BK
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    bias_or_any = weight if bias is None else bias
    dense_rows_kernel[(-(-n // bn), splits)](
        x, x if up is None else up, weight, bias_or_any, y, part, arrivals(weight) if splits > 1 else y, t, n,
        x.stride(0), K=k, BN=bn, BK=BK, SPAN=span, SPLITS=splits, HAS_BIAS=bias is not None, GLU=up is not None,
        num_warps=4, num_stages=3)
    return y
