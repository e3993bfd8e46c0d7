"""One token's dense projection as a GEMV: y = W x (+ b), W [N, K] bf16 read once, fp32 accumulation; with GLU,
x = silu(gate) * up (a SwiGLU MLP's down projection), each rounded to the activation dtype as torch rounds them."""

import triton
import triton.language as tl


@triton.jit
def _weights(w_ptr, n, live, k0, end, K: tl.constexpr, BK: tl.constexpr):
    k = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & (k < end)[None, :],
                   other=0.0)


@triton.jit
def _input(x_ptr, up_ptr, k, K: tl.constexpr, GLU: tl.constexpr):
    x = tl.load(x_ptr + k, mask=k < K, other=0.0)
    if GLU:
        dt = x_ptr.dtype.element_ty
        g = x.to(tl.float32)
        x = ((g / (1.0 + tl.exp(-g))).to(dt) * tl.load(up_ptr + k, mask=k < K, other=0.0)).to(dt)
    return x.to(tl.float32)


@triton.jit
def dense_gemv_kernel(x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, part_ptr, N, K: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GLU: tl.constexpr):
    """Program (i, s): the BN rows n of block i over columns s * SPAN .. (s + 1) * SPAN in chunks of BK (masked
    past K). One split stores y; several store fp32 partials part[s, n], which split_sum_kernel adds in order."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    live = n < N
    start = tl.program_id(1) * SPAN
    end = tl.minimum(start + SPAN, K)
    w = _weights(w_ptr, n, live, start, end, K, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(start, end, BK):
        k = k0 + tl.arange(0, BK)
        acc += w.to(tl.float32) * _input(x_ptr, up_ptr, k, K, GLU)[None, :]
        w = _weights(w_ptr, n, live, k0 + BK, end, K, BK)  # the next chunk (past the span: masked, nothing read)
    y = tl.sum(acc, axis=1)
    if SPLITS > 1:
        tl.store(part_ptr + tl.program_id(1) * N + n, y, mask=live)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def split_sum_kernel(part_ptr, b_ptr, y_ptr, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[n] = sum over splits s, in order, of part[s, n] (+ bias): the same bits every run."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = n < N
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        y += tl.load(part_ptr + s * N + n, mask=live, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def dense_rows_kernel(x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, part_ptr, T, N, stride_x, K: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                      ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, IEEE: tl.constexpr):
    """y[t, n] for the T <= ROWS token rows t and the BN weight rows n of program (i, s), over columns s * SPAN ..
    (s + 1) * SPAN: W [BN, BK] @ x^T [BK, ROWS] on the tensor cores. Rows past T are zeros, and every output's
    arithmetic is fixed by the constexpr shapes, not by the other rows' values, so a token's result is the same bits
    whatever T is (batch invariance). Several splits store fp32 partials part[s, t, n] for split_sum_kernel."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.arange(0, ROWS)
    live, rows = n < N, t < T
    dt = x_ptr.dtype.element_ty
    start = tl.program_id(1) * SPAN
    end = tl.minimum(start + SPAN, K)
    acc = tl.zeros((BN, ROWS), dtype=tl.float32)
    for k0 in range(start, end, BK):
        k = k0 + tl.arange(0, BK)
        inside = k < end
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
        at = t[None, :] * stride_x + k[:, None]
        x = tl.load(x_ptr + at, mask=rows[None, :] & inside[:, None], other=0.0)
        if GLU:
            g = x.to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dt) * tl.load(up_ptr + at, mask=rows[None, :] & inside[:, None],
                                                           other=0.0)).to(dt)
        acc = tl.dot(w.to(dt), x, acc, input_precision="ieee" if IEEE else "tf32")
    out = t[None, :] * N + n[:, None]
    if SPLITS > 1:
        tl.store(part_ptr + tl.program_id(1) * T * N + out, acc, mask=rows[None, :] & live[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=rows[None, :] & live[:, None])
