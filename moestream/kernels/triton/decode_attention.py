"""Decode attention, flash-decoding style: query tokens, each over a fixed-size KV cache of which positions
0..position (read from a device tensor) are live, stored in place or at the rows of a paged cache's row map. A
split kernel (grid (kv heads, SPLITS, tokens)) runs an online softmax over its slice of positions for the G query
heads sharing a kv head; a combine kernel (grid (query heads, tokens)) merges the SPLITS partials. The grids
depend on the cache size alone, so one captured CUDA graph serves every step; a token's bits do not depend on how
many share the launch."""

import triton
import triton.language as tl


@triton.jit
def decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, map_ptr, moff_ptr, pos_ptr, rows_ptr, acc_ptr, m_ptr, l_ptr,
                                  qk_scale, C, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                  GP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
                                  SPLITS: tl.constexpr, ROWS: tl.constexpr, MAP: tl.constexpr, OFFSETS: tl.constexpr):
    """Partials of split s for kv head hk and query token t: acc [G, D] = sum_n p_n v_n, m = max score,
    l = sum_n p_n, with scores in log2 units (qk_scale = scale * log2(e)). An empty split leaves m = -inf, l = 0,
    acc = 0. With MAP, position p is stored at row map[p] (a paged cache), token t's map starting moff[t] elements
    past map_ptr with OFFSETS (a batch's rows, each its own sequence's map); else at row p. Token t's position is
    pos[t]. With ROWS, the positions are the C entries of rows_ptr (-1 for none) instead of 0..position."""
    hk = tl.program_id(0)
    s = tl.program_id(1)
    t = tl.program_id(2)
    if OFFSETS:
        map_ptr += tl.load(moff_ptr + t)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    # GP >= 16 rows so tl.dot applies; rows past G are zero queries whose results are never stored
    heads = hk * G + g
    q = tl.load(q_ptr + (t * HKV * G + heads[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
    end = C if ROWS else tl.minimum(tl.load(pos_ptr + t) + 1, C)
    start = s * SPLIT_LEN
    stop = tl.minimum(start + SPLIT_LEN, end)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < stop
        if ROWS:
            n = tl.load(rows_ptr + n, mask=live, other=-1)
            live = n >= 0
        if MAP:
            n = tl.load(map_ptr + n, mask=live, other=0)
        rows = n.to(tl.int64)[:, None] * (HKV * D) + hk * D + d[None, :]
        # masked loads: rows past `position` may hold anything (even NaN) and must never be read
        k = tl.load(k_ptr + rows, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + rows, mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        # every block of 0..position holds a live position, so m_new is finite and p is exactly 0 where masked;
        # a block of rows may hold none (-inf - -inf would be NaN)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_ref = m_new
        if ROWS:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    part = (t * HKV * G + heads) * SPLITS + s
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g[:, None] < G)
    tl.store(m_ptr + part, m, mask=g < G)
    tl.store(l_ptr + part, l, mask=g < G)


@triton.jit
def decode_attention_combine_kernel(acc_ptr, m_ptr, l_ptr, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW, HQ,
                                    D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                                    GATE: tl.constexpr):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, in a fixed order (deterministic); with GATE,
    rounded, then times sigmoid(gate[t, h]) (at gate_ptr + t * GATE_ROW + h * GATE_STRIDE), rounded as torch
    does."""
    head, t = tl.program_id(0), tl.program_id(1)
    h = t * HQ + head  # the partials and the output are [T, HQ, ...]
    i = tl.arange(0, SPLITS_P)
    # some split holds a live row (position 0, or the query's own), so the max is finite and empty splits weigh 0
    m = tl.load(m_ptr + h * SPLITS + i, mask=i < SPLITS, other=float("-inf"))
    big = tl.max(m, axis=0)
    den = tl.sum(tl.exp2(m - big) * tl.load(l_ptr + h * SPLITS + i, mask=i < SPLITS, other=0.0), axis=0)
    d = tl.arange(0, D)
    num = tl.zeros((D,), tl.float32)
    for s in range(SPLITS):
        w = tl.exp2(tl.load(m_ptr + h * SPLITS + s) - big)
        num += w * tl.load(acc_ptr + (h * SPLITS + s) * D + d)
    dt = out_ptr.dtype.element_ty
    out = (num / den).to(dt)
    if GATE:
        g = tl.load(gate_ptr + t * GATE_ROW + head * GATE_STRIDE + d).to(tl.float32)
        out = (out * (1.0 / (1.0 + tl.exp(-g))).to(dt)).to(dt)
    tl.store(out_ptr + h * D + d, out)
