"""One token's dense projection as a GEMV: y = W x (+ b), W [N, K] bf16 read once, fp32 accumulation."""

import triton
import triton.language as tl

from moestream.kernels.triton.launch import dependent_start


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Program i: y[n] for the BN rows n of block i, over K in chunks of BK (the last one masked)."""
    dependent_start(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    live = n < N
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        inside = k < K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=inside, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=live)
