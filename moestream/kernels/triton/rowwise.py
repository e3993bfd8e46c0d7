"""Row-wise glue of the attention block, each one launch instead of the torch version's several: RMSNorm
(one program per row, optionally after the residual add), the rotary embedding (one program per token and
head), a decode token's q/k norms, rotary and cache write (one program per head) and MoE routing (one
program per token)."""

import triton
import triton.language as tl

from moestream.kernels.triton.combine import combined


@triton.jit
def _normed(x, inv_rms, w, dt, ZERO_CENTERED: tl.constexpr):
    """RMSNorm of fp32 x given 1 / rms(x), in fp32 (the plain form rounds norm(x) to `dt` first, as the
    reference does)."""
    if ZERO_CENTERED:
        return x * inv_rms * (1.0 + w)
    return w * (x * inv_rms).to(dt).to(tl.float32)


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr, ADD: tl.constexpr, GROUPS: tl.constexpr):
    """out[r] = w * norm(x[r]), or (1 + w) * norm(x[r]) with ZERO_CENTERED; w is slice r % GROUPS of the weight
    [GROUPS * D] (grouped norms: row r of the [T * GROUPS, D] view). With ADD the row is first
    x[r] + res[r], rounded to x's dtype and stored to sum[r] (the residual stream, in the same launch)."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    x = tl.load(x_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        x = (x + tl.load(res_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + r * D + d, x, mask=inside)
        x = x.to(tl.float32)
    w = tl.load(w_ptr + (r % GROUPS) * D + d, mask=inside, other=0.0).to(tl.float32)
    y = _normed(x, tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), w, x_ptr.dtype.element_ty, ZERO_CENTERED)
    tl.store(out_ptr + r * D + d, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def combine_add_rms_norm_kernel(x_ptr, y_ptr, rw_ptr, shared_ptr, gate_ptr, sum_ptr, w_ptr, out_ptr, eps,
                                D: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                                ZERO_CENTERED: tl.constexpr):
    """rms_norm_kernel with ADD, its residual row the MoE block's output made here (combine_kernel's `combined`)
    rather than read: sum[r] = x[r] + combined(r), out[r] = its RMSNorm, in one launch."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    dt = x_ptr.dtype.element_ty
    res = combined(y_ptr, rw_ptr, shared_ptr, gate_ptr, r, d, inside, dt, D, TOP_K, BLOCK, SHARED)
    x = (tl.load(x_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(sum_ptr + r * D + d, x, mask=inside)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    y = _normed(x, tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), w, dt, ZERO_CENTERED)
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
    """Program r: token r's routing (top_k_rows) from its E router logits."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + r * E + e[None, :], mask=e[None, :] < E, other=float("-inf")).to(tl.float32)
    chosen_p, chosen_e = top_k_rows(logits, E, BLOCK, TOP_K, K_BLOCK, NORMALISE, 1)
    k = tl.arange(0, K_BLOCK)[None, :]
    tl.store(weights_ptr + r * TOP_K + k, chosen_p.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)
    tl.store(ids_ptr + r * TOP_K + k, chosen_e, mask=k < TOP_K)


@triton.jit
def top_k_rows(logits, E: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
               NORMALISE: tl.constexpr, ROWS: tl.constexpr):
    """Router logits [ROWS, BLOCK] in fp32 (-inf past E) -> (weights [ROWS, K_BLOCK] fp32, expert ids int64): a
    softmax, then the TOP_K largest, largest first (a tie goes to the lower expert id), optionally renormalised to
    sum to 1."""
    e = tl.arange(0, BLOCK)[None, :]
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    k = tl.arange(0, K_BLOCK)[None, :]
    chosen_p = tl.zeros((ROWS, K_BLOCK), dtype=tl.float32)
    chosen_e = tl.zeros((ROWS, K_BLOCK), dtype=tl.int64)
    left = tl.where(e < E, p, -1.0)
    for i in tl.static_range(TOP_K):
        best = tl.max(left, axis=1)[:, None]
        idx = tl.min(tl.where(left == best, e, BLOCK), axis=1)[:, None]
        chosen_p = tl.where(k == i, best, chosen_p)
        chosen_e = tl.where(k == i, idx.to(tl.int64), chosen_e)
        left = tl.where(e == idx, -1.0, left)
    if NORMALISE:
        chosen_p = chosen_p / tl.sum(chosen_p, axis=1)[:, None]
    return chosen_p, chosen_e


@triton.jit
def qk_norm_rope_cache_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                              map_ptr, moff_ptr, eps, T, QKV_ROW, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                              D: tl.constexpr, Q_STRIDE: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr,
                              ROWS: tl.constexpr, QK_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                              MAP: tl.constexpr, OFFSETS: tl.constexpr):
    """Tokens' attention glue, program (h, b) = one head of tokens b * ROWS.. of the fused [q | k | v] projection
    rows (QKV_ROW apart): q heads (every Q_STRIDE, gate halves skipped) and k heads are RMS-normed (QK_NORM) and
    rotated into q / the cache row of position pos[t]; v heads are copied there. With MAP that row is map[pos[t]] (a
    paged cache), token t's map starting moff[t] elements past map_ptr with OFFSETS (a batch's rows, each its own
    sequence's map). Rounds where rms_norm and rotary round."""
    h, b = tl.program_id(0), tl.program_id(1)
    t = b * ROWS + tl.arange(0, ROWS)
    live = t < T
    pos = tl.load(pos_ptr + t, mask=live, other=0)
    maps = map_ptr
    if OFFSETS:
        maps += tl.load(moff_ptr + t, mask=live, other=0)
    if MAP:
        pos = tl.load(maps + pos, mask=live, other=0)
    src_row = qkv_ptr + t[:, None] * QKV_ROW
    d = tl.arange(0, BLOCK)[None, :]
    inside = (d < D) & live[:, None]
    dt = qkv_ptr.dtype.element_ty
    Q_WIDTH: tl.constexpr = HEADS * Q_STRIDE
    if h >= HEADS + KV_HEADS:  # v
        j = h - HEADS - KV_HEADS
        v = tl.load(src_row + Q_WIDTH + (KV_HEADS + j) * D + d, mask=inside)
        tl.store(v_cache_ptr + (pos[:, None] * KV_HEADS + j) * D + d, v, mask=inside)
    else:
        if h < HEADS:
            src, w_ptr, dst = src_row + h * Q_STRIDE, qw_ptr, q_ptr + (t[:, None] * HEADS + h) * D
        else:
            src, w_ptr = src_row + Q_WIDTH + (h - HEADS) * D, kw_ptr
            dst = k_cache_ptr + (pos[:, None] * KV_HEADS + h - HEADS) * D
        HALF: tl.constexpr = ROT // 2
        # each rotary dim's rotate-half partner and sign; dims past ROT pass through (their partner is themselves)
        partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
        sign = tl.where(d < HALF, -1.0, 1.0)
        x = tl.load(src + d, mask=inside, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=inside, other=0.0).to(tl.float32)
        if QK_NORM:
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = _normed(x, inv_rms, tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32), dt, ZERO_CENTERED)
            xp = _normed(xp, inv_rms, tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32), dt,
                         ZERO_CENTERED)
            x, xp = x.to(dt).to(tl.float32), xp.to(dt).to(tl.float32)
        rot = (d < ROT) & live[:, None]
        c = tl.load(cos_ptr + t[:, None] * ROT + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t[:, None] * ROT + d, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(d < ROT, (x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32), x)
        tl.store(dst + d, y.to(dt), mask=inside)
