"""A decode step's dense projections as GEMVs: y = W x (+ b) for up to a few token rows, W [N, K] bf16 read once a
group of rows, fp32 accumulation; with GLU, x = silu(gate) * up (a SwiGLU MLP's down projection), each rounded
to the activation dtype as torch rounds them."""

import triton
import triton.language as tl


@triton.jit
def _weights(w_ptr, n, live, k0, end, K: tl.constexpr, BK: tl.constexpr):
    k = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & (k < end)[None, :],
                   other=0.0)


@triton.jit
def _input(x_ptr, up_ptr, k, live, K: tl.constexpr, GLU: tl.constexpr):
    x = tl.load(x_ptr + k, mask=live & (k < K), other=0.0)
    if GLU:
        dt = x_ptr.dtype.element_ty
        g = x.to(tl.float32)
        x = ((g / (1.0 + tl.exp(-g))).to(dt) * tl.load(up_ptr + k, mask=live & (k < K), other=0.0)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _store(y, r, T, y_ptr, b_ptr, part_ptr, n, live, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row r's BN outputs: y (+ bias), or its split's fp32 partial."""
    if SPLITS > 1:
        tl.store(part_ptr + (tl.program_id(1) * T + r) * N + n, y, mask=live & (r < T))
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * N + n, y.to(y_ptr.dtype.element_ty), mask=live & (r < T))


@triton.jit
def dense_gemv_kernel(x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, part_ptr, T, N, stride_x, K: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr):
    """Program (i, s, g): the BN weight rows n of block i for the GROUP token rows of group g (x row stride
    stride_x; rows past T masked), over columns s * SPAN .. (s + 1) * SPAN in chunks of BK (masked past K). Each row
    has its own accumulator with the same code, so a row's bits do not depend on T or on its group (batch
    invariance). One split stores y [T, N]; several store fp32 partials part[s, t, n] for split_sum_kernel."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    live = n < N
    start = tl.program_id(1) * SPAN
    end = tl.minimum(start + SPAN, K)
    r = tl.program_id(2) * GROUP
    x0, u0 = x_ptr + r * stride_x, up_ptr + r * stride_x
    w = _weights(w_ptr, n, live, start, end, K, BK)
    acc0 = tl.zeros((BN, BK), dtype=tl.float32)
    acc1 = tl.zeros((BN, BK), dtype=tl.float32)
    acc2 = tl.zeros((BN, BK), dtype=tl.float32)
    acc3 = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(start, end, BK):
        k = k0 + tl.arange(0, BK)
        wf = w.to(tl.float32)
        acc0 += wf * _input(x0, u0, k, r < T, K, GLU)[None, :]
        if GROUP > 1:
            acc1 += wf * _input(x0 + stride_x, u0 + stride_x, k, r + 1 < T, K, GLU)[None, :]
        if GROUP > 2:
            acc2 += wf * _input(x0 + 2 * stride_x, u0 + 2 * stride_x, k, r + 2 < T, K, GLU)[None, :]
            acc3 += wf * _input(x0 + 3 * stride_x, u0 + 3 * stride_x, k, r + 3 < T, K, GLU)[None, :]
        w = _weights(w_ptr, n, live, k0 + BK, end, K, BK)  # the next chunk (past the span: masked, nothing read)
    _store(tl.sum(acc0, axis=1), r, T, y_ptr, b_ptr, part_ptr, n, live, N, SPLITS, HAS_BIAS)
    if GROUP > 1:
        _store(tl.sum(acc1, axis=1), r + 1, T, y_ptr, b_ptr, part_ptr, n, live, N, SPLITS, HAS_BIAS)
    if GROUP > 2:
        _store(tl.sum(acc2, axis=1), r + 2, T, y_ptr, b_ptr, part_ptr, n, live, N, SPLITS, HAS_BIAS)
        _store(tl.sum(acc3, axis=1), r + 3, T, y_ptr, b_ptr, part_ptr, n, live, N, SPLITS, HAS_BIAS)


@triton.jit
def split_sum_kernel(part_ptr, b_ptr, y_ptr, TOTAL, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """y[i] = sum over splits s, in order, of part[s, i] (+ bias[i % N]) for the TOTAL = T * N outputs: the same
    bits every run."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < TOTAL
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        y += tl.load(part_ptr + s * TOTAL + i, mask=live, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + i % N, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=live)
