"""RMSNorm, one program per row: the eight elementwise kernels of the torch version in one launch."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """out[r] = w * norm(x[r]) (the normed row rounded to x's dtype first, as the reference does), or
    (1 + w) * norm(x[r]) with ZERO_CENTERED."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    x = tl.load(x_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = normed * (1.0 + w)
    else:
        y = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * D + d, y.to(out_ptr.dtype.element_ty), mask=inside)
