"""The MoE block's output: each token's top-k expert outputs summed in k order with their routing weights, plus
the gated shared expert, in one launch (torch takes a batched product and three elementwise kernels), or inside the
next layer's add + RMSNorm (triton/rowwise.py)."""

import triton
import triton.language as tl


@triton.jit
def combine_kernel(y_ptr, w_ptr, shared_ptr, gate_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK: tl.constexpr, SHARED: tl.constexpr):
    """Program (t, i): out[t, h] for the BLOCK columns h of block i (combined)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = h < H
    out = combined(y_ptr, w_ptr, shared_ptr, gate_ptr, t, h, inside, out_ptr.dtype.element_ty, H, TOP_K, BLOCK,
                   SHARED)
    tl.store(out_ptr + t * H + h, out, mask=inside)


@triton.jit
def combined(y_ptr, w_ptr, shared_ptr, gate_ptr, t, h, inside, dt, H: tl.constexpr, TOP_K: tl.constexpr,
             BLOCK: tl.constexpr, SHARED: tl.constexpr):
    """Token t's columns h in `dt`: sum_k w[t, k] y[t, k, h] (fp32, k in order, rounded once), then
    + round(round(sigmoid(gate[t])) * shared[t, h]) where torch rounds each product."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
        acc += w * tl.load(y_ptr + (t * TOP_K + k) * H + h, mask=inside, other=0.0).to(tl.float32)
    out = acc.to(dt)
    if SHARED:
        g = tl.load(gate_ptr + t).to(tl.float32)
        scale = (1.0 / (1.0 + tl.exp(-g))).to(dt)
        part = (scale * tl.load(shared_ptr + t * H + h, mask=inside, other=0.0)).to(dt)
        out = (out.to(tl.float32) + part.to(tl.float32)).to(dt)
    return out
