"""Row-wise glue of the attention block, each one launch instead of the torch version's several: RMSNorm
(one program per row), the rotary embedding (one program per token and head) and MoE routing (one
program per token)."""

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


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                  HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr):
    """Rotate-half over the first ROT dims of x[t, head]; rounding to x's dtype after each product and
    after the sum, as the torch reference does."""
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + (t * HEADS + tl.program_id(1)) * D
    out = out_ptr + (t * HEADS + tl.program_id(1)) * D
    HALF: tl.constexpr = ROT // 2
    i = tl.arange(0, HALF_BLOCK)
    m = i < HALF
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(row + i, mask=m, other=0.0)
    x2 = tl.load(row + HALF + i, mask=m, other=0.0)
    c1, c2 = tl.load(cos_ptr + t * ROT + i, mask=m, other=0.0), tl.load(cos_ptr + t * ROT + HALF + i, mask=m, other=0.0)
    s1, s2 = tl.load(sin_ptr + t * ROT + i, mask=m, other=0.0), tl.load(sin_ptr + t * ROT + HALF + i, mask=m, other=0.0)
    y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(out + i, y1.to(dt), mask=m)
    tl.store(out + HALF + i, y2.to(dt), mask=m)
    if ROT < D:  # the dims past the rotary part pass through
        j = ROT + tl.arange(0, REST_BLOCK)
        tl.store(out + j, tl.load(row + j, mask=j < D), mask=j < D)


@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, E: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                 K_BLOCK: tl.constexpr, NORMALISE: tl.constexpr):
    """Softmax over a token's E router logits in fp32, then the TOP_K largest, largest first (a tie goes to
    the lower expert id), optionally renormalised to sum to 1."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + r * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    k = tl.arange(0, K_BLOCK)
    chosen_p = tl.zeros((K_BLOCK,), dtype=tl.float32)
    chosen_e = tl.zeros((K_BLOCK,), dtype=tl.int64)
    left = tl.where(e < E, p, -1.0)
    for i in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, e, BLOCK), axis=0)
        chosen_p = tl.where(k == i, best, chosen_p)
        chosen_e = tl.where(k == i, idx.to(tl.int64), chosen_e)
        left = tl.where(e == idx, -1.0, left)
    if NORMALISE:
        chosen_p = chosen_p / tl.sum(chosen_p, axis=0)
    tl.store(weights_ptr + r * TOP_K + k, chosen_p.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)
    tl.store(ids_ptr + r * TOP_K + k, chosen_e, mask=k < TOP_K)
