"""Decode attention, flash-decoding style: query tokens, each over a fixed-size KV cache of which positions
0..position (read from a device tensor) are live, stored in place or at the rows of a paged cache's row map. A
split kernel (grid (kv heads, programs, tokens), each program taking every programs-th split) runs an online
softmax over a split's slice of positions for the G query heads sharing a kv head; where one split holds every live
position it writes the output itself, else the last live split to finish merges the live splits' partials (one
launch, not a split and a combine kernel). The splits depend on the cache size alone, so one captured CUDA graph
serves every step; a token's bits depend neither on how many share the launch nor on how splits share programs."""

import triton
import triton.language as tl


@triton.jit
def decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, map_ptr, moff_ptr, pos_ptr, rows_ptr, acc_ptr, m_ptr, l_ptr,
                                  counts_ptr, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW, qk_scale, C, PROGRAMS,
                                  HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
                                  BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr,
                                  ROWS: tl.constexpr, MAP: tl.constexpr, OFFSETS: tl.constexpr, GATE: tl.constexpr):
    """Partials of each live split s for kv head hk and query token t: acc [G, D] = sum_n p_n v_n, m = max score,
    l = sum_n p_n, with scores in log2 units (qk_scale = scale * log2(e)). With MAP, position p is stored at row
    map[p] (a paged cache), token t's map starting moff[t] elements past map_ptr with OFFSETS (a batch's rows, each
    its own sequence's map); else at row p. Token t's position is pos[t]. With ROWS, the positions are the C entries
    of rows_ptr (-1 for none) instead of 0..position. Program p takes splits p, p + PROGRAMS, ..."""
    hk = tl.program_id(0)
    t = tl.program_id(2)
    if OFFSETS:
        map_ptr += tl.load(moff_ptr + t)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    # GP >= 16 rows so tl.dot applies; rows past G are zero queries whose results are never stored
    heads = hk * G + g
    q = tl.load(q_ptr + (t * HKV * G + heads[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
    end = C if ROWS else tl.minimum(tl.load(pos_ptr + t) + 1, C)
    used = tl.cdiv(end, SPLIT_LEN)  # splits holding live positions
    # program p takes splits p, p + PROGRAMS, ... below `used`: how splits share programs never changes a bit
    for s in range(tl.program_id(1), used, PROGRAMS):
        _split(q, k_ptr, v_ptr, map_ptr, rows_ptr, acc_ptr, m_ptr, l_ptr, counts_ptr, gate_ptr, out_ptr, GATE_STRIDE,
               GATE_ROW, qk_scale, s, end, used, t, hk, heads, g, d, HKV, G, D, GP, BLOCK_N, SPLIT_LEN, SPLITS,
               ROWS, MAP, GATE)


@triton.jit
def _split(q, k_ptr, v_ptr, map_ptr, rows_ptr, acc_ptr, m_ptr, l_ptr, counts_ptr, gate_ptr, out_ptr, GATE_STRIDE,
           GATE_ROW, qk_scale, s, end, used, t, hk, heads, g, d, HKV: tl.constexpr, G: tl.constexpr,
           D: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr,
           ROWS: tl.constexpr, MAP: tl.constexpr, GATE: tl.constexpr):
    """Split s's online softmax; one live split is the answer itself (what the merge of it with empty splits gave:
    the same bits), else the last live split to finish merges them."""
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
    if used == 1:
        _finish(acc, l, t, heads, d, g < G, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW, HKV * G, D, GATE)
    else:
        base = (t * HKV * G + heads) * SPLITS
        tl.store(acc_ptr + (base + s)[:, None] * D + d[None, :], acc, mask=g[:, None] < G)
        tl.store(m_ptr + base + s, m, mask=g < G)
        tl.store(l_ptr + base + s, l, mask=g < G)
        tl.debug_barrier()  # every thread's partials are stored before the count that releases them
        if tl.atomic_add(counts_ptr + t * HKV + hk, 1, sem="acq_rel") == used - 1:
            _merge(acc_ptr, m_ptr, l_ptr, base, used, t, heads, d, g < G, gate_ptr, out_ptr, GATE_STRIDE,
                   GATE_ROW, HKV * G, GP, D, GATE)
            tl.store(counts_ptr + t * HKV + hk, 0)


@triton.jit
def _merge(acc_ptr, m_ptr, l_ptr, base, used, t, heads, d, rows, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW,
           HQ: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr):
    """The `used` splits' partials merged in split order, an online softmax over them (a split of rows may hold none:
    m = -inf, l = 0)."""
    big = tl.full((GP,), float("-inf"), tl.float32)
    den = tl.zeros((GP,), tl.float32)
    num = tl.zeros((GP, D), tl.float32)
    for j in range(used):
        m_j = tl.load(m_ptr + base + j, mask=rows, other=float("-inf"), cache_modifier=".cg")
        new = tl.maximum(big, m_j)
        ref = tl.where(new == float("-inf"), 0.0, new)
        old, now = tl.exp2(big - ref), tl.exp2(m_j - ref)
        den = den * old + now * tl.load(l_ptr + base + j, mask=rows, other=0.0, cache_modifier=".cg")
        num = num * old[:, None] + now[:, None] * tl.load(acc_ptr + (base + j)[:, None] * D + d[None, :],
                                                          mask=rows[:, None], other=0.0, cache_modifier=".cg")
        big = new
    _finish(num, den, t, heads, d, rows, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW, HQ, D, GATE)


@triton.jit
def _finish(num, den, t, heads, d, rows, gate_ptr, out_ptr, GATE_STRIDE, GATE_ROW, HQ: tl.constexpr, D: tl.constexpr,
            GATE: tl.constexpr):
    """out[t, heads] = num / den for the heads of `rows`, rounded; with GATE, times sigmoid(gate[t, heads]) (at
    gate_ptr + t * GATE_ROW + head * GATE_STRIDE), rounded as torch does."""
    dt = out_ptr.dtype.element_ty
    out = (num / den[:, None]).to(dt)
    if GATE:
        g = tl.load(gate_ptr + t * GATE_ROW + heads[:, None] * GATE_STRIDE + d[None, :], mask=rows[:, None],
                    other=0.0)
        out = (out * (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(dt)).to(dt)
    tl.store(out_ptr + (t * HQ + heads)[:, None] * D + d[None, :], out, mask=rows[:, None])
