"""Launching the dense decode kernel: a decode step's projections for up to DECODE_MAX_ROWS token rows, one launch
each, the weights read once for every row (cuBLAS ran the [q|k|v] projection as a split-K GEMM plus a reduction
kernel, at about half the HBM rate, and its tiles change with the number of rows; a GEMV with an accumulator per
row read the weights once per 4 rows: 16 rows cost 4-8x one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kernels.launch import arrival_counts

BK = 128  # K chunk: a [16, BK] x [BK, BN] tensor-core product
MIN_PROGRAMS = 528  # four blocks an SM of the H200's 132


def arrivals(weight: torch.Tensor) -> torch.Tensor:
    """The counts a split or routing launch over `weight` keeps (launch.arrival_counts), one set a weight: a block's
    splits, and the blocks last. Two streams never run such launches of one weight at once: prompts beside decoding
    steps run more rows than DECODE_MAX_ROWS."""
    return arrival_counts(("dense_gemv", weight.data_ptr()), MIN_PROGRAMS + 1, weight.device)


def plan(n: int, k: int) -> tuple[int, int]:
    """(weight rows a block, splits of K): 64 rows (16 for a small N), K split in powers of two while the blocks are
    too few to fill the GPU and each split keeps a few chunks. The tiles depend on the weight's shape alone."""
    bn, splits = (64 if n >= 512 else 16), 1
    while -(-n // bn) * splits < MIN_PROGRAMS and k // (2 * splits) >= 2 * BK:
        splits *= 2
    return bn, splits


@dataclass(frozen=True)
class Route:
    """A router's launch also routes its rows: softmax over the first `experts` outputs, the top_k (rowwise.route)."""

    experts: int
    top_k: int
    normalise: bool
    dtype: torch.dtype
    ids_out: torch.Tensor | None = None  # where the ids land ([T * top_k] int64), else a new tensor


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               up: torch.Tensor | None = None, route: Route | None = None):
    """x [T, K] (T <= 16, rows of any stride) -> [T, N] = x @ weight.T (+ bias); weight [N, K] contiguous. With `up`
    (x's shape and strides), the input is silu(x) * up instead (the down projection of a SwiGLU MLP, its gate and
    up products never stored). A row's bits are the same whatever T is: the tiles depend on the weight's shape
    only, and every launch computes 16 rows. With `route`, (y, routing weights [T, top_k], ids [T, top_k])."""
    from moestream.kernels.triton.dense_gemv import dense_rows_kernel

    t, k = x.shape
    n = weight.shape[0]
    assert t <= 16
    if x.stride(1) != 1 or (up is not None and up.stride() != x.stride()):  # rows the kernel cannot stride over
        x, up = x.contiguous(), None if up is None else up.contiguous()
    bn, splits = plan(n, k)
    assert route is None or (route.experts <= n and -(-n // bn) <= MIN_PROGRAMS)
    span = -(-k // (splits * BK)) * BK
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    bias_or_any = weight if bias is None else bias
    routed = () if route is None else (
        torch.empty(t, route.top_k, dtype=route.dtype, device=x.device),
        torch.empty(t, route.top_k, dtype=torch.int64, device=x.device) if route.ids_out is None
        else route.ids_out.view(t, route.top_k))
    counts = arrivals(weight) if splits > 1 or route is not None else y
    shape = dict(ROUTE=False, E=1, E_BLOCK=1, TOP_K=1, K_BLOCK=1, NORMALISE=False)
    if route is not None:
        shape = dict(ROUTE=True, E=route.experts, E_BLOCK=1 << (route.experts - 1).bit_length(), TOP_K=route.top_k,
                     K_BLOCK=1 << (route.top_k - 1).bit_length(), NORMALISE=route.normalise)
    dense_rows_kernel[(-(-n // bn), splits)](
        x, x if up is None else up, weight, bias_or_any, y, part, counts, *(routed or (y, y)), t, n, x.stride(0),
        K=k, BN=bn, BK=BK, SPAN=span, SPLITS=splits, HAS_BIAS=bias is not None, GLU=up is not None, **shape,
        num_warps=4, num_stages=3)
    return y if route is None else (y, *routed)
