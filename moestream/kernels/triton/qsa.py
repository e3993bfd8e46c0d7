"""QSA's decode step: the indexer's key written (and a block's key when the token completes it), every block
scored against the index queries, and the chosen blocks' cache rows listed in block order, with no sort and no
host decision (one program selects, by a binary search over the scores' bits)."""

import triton
import triton.language as tl


@triton.jit
def block_key_kernel(raw_ptr, index_keys_ptr, block_keys_ptr, w_ptr, inv_freq_ptr, pos_ptr, eps,
                     DI: tl.constexpr, BLOCK: tl.constexpr, RATIO: tl.constexpr, ROT: tl.constexpr):
    """Stores the raw key at index_keys[pos]; where pos + 1 completes a block, block_keys[block] = rotary(
    zero-centred norm(mean of its RATIO raw keys)) at the block's first position, rounding as the torch
    reference does (mean in fp32, each rotary product rounded)."""
    pos = tl.load(pos_ptr)
    d = tl.arange(0, BLOCK)
    inside = d < DI
    dt = raw_ptr.dtype.element_ty
    raw = tl.load(raw_ptr + d, mask=inside, other=0.0)
    tl.store(index_keys_ptr + pos * DI + d, raw, mask=inside)
    if (pos + 1) % RATIO == 0:
        HALF: tl.constexpr = ROT // 2
        partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
        start = pos + 1 - RATIO
        acc = tl.zeros((BLOCK,), tl.float32)
        acc_p = tl.zeros((BLOCK,), tl.float32)
        for i in tl.static_range(RATIO - 1):  # the earlier rows of the block, then this one, in order
            acc += tl.load(index_keys_ptr + (start + i) * DI + d, mask=inside, other=0.0).to(tl.float32)
            acc_p += tl.load(index_keys_ptr + (start + i) * DI + partner, mask=inside, other=0.0).to(tl.float32)
        x = ((acc + raw.to(tl.float32)) / RATIO).to(dt).to(tl.float32)
        xp = ((acc_p + tl.load(raw_ptr + partner, mask=inside, other=0.0).to(tl.float32)) / RATIO).to(dt)
        xp = xp.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / DI + eps)
        x = (x * inv_rms * (1.0 + tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32))).to(dt)
        xp = (xp * inv_rms * (1.0 + tl.load(w_ptr + partner, mask=inside, other=0.0).to(tl.float32))).to(dt)
        x, xp = x.to(tl.float32), xp.to(tl.float32)
        rot = d < ROT
        angle = start.to(tl.float32) * tl.load(inv_freq_ptr + d % HALF, mask=rot, other=0.0)
        c, s = tl.cos(angle).to(dt).to(tl.float32), tl.sin(angle).to(dt).to(tl.float32)
        sign = tl.where(d < HALF, -1.0, 1.0)
        y = tl.where(rot, (x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32), x)
        tl.store(block_keys_ptr + ((pos + 1) // RATIO - 1) * DI + d, y.to(dt), mask=inside)


@triton.jit
def block_scores_kernel(q_ptr, keys_ptr, scores_ptr, B, sqrt_di, HI: tl.constexpr, DI: tl.constexpr,
                        BB: tl.constexpr, BD: tl.constexpr):
    """scores[b] = sum_h relu(q_h . key_b) / sqrt(DI) for the BB block rows b of program i (fp32)."""
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    d = tl.arange(0, BD)
    live = b < B
    keys = tl.load(keys_ptr + b.to(tl.int64)[:, None] * DI + d[None, :], mask=live[:, None] & (d < DI)[None, :],
                   other=0.0).to(tl.float32)
    acc = tl.zeros((BB,), tl.float32)
    for h in tl.static_range(HI):
        q = tl.load(q_ptr + h * DI + d, mask=d < DI, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.sum(keys * q[None, :], axis=1), 0.0)
    tl.store(scores_ptr + b, acc / sqrt_di, mask=live)


@triton.jit
def _count_at_least(scores_ptr, complete, threshold, CHUNK: tl.constexpr):
    """How many of scores[0:complete] have float bits >= threshold (non-negative floats order as their bits)."""
    n = tl.zeros((), tl.int32)
    for b0 in range(0, complete, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        bits = tl.load(scores_ptr + b, mask=b < complete, other=-1.0).to(tl.int32, bitcast=True)
        n += tl.sum((bits >= threshold).to(tl.int32), axis=0)
    return n


@triton.jit
def select_rows_kernel(scores_ptr, pos_ptr, rows_ptr, RATIO: tl.constexpr, TOPK: tl.constexpr,
                       CHUNK: tl.constexpr, RATIO_P: tl.constexpr):
    """rows[0:TOPK*RATIO] = the cache rows of the TOPK best complete blocks in block order (a tie at the k-th
    score to the lower block), -1 past them; rows[TOPK*RATIO:] = the incomplete block's rows up to pos, else -1."""
    pos = tl.load(pos_ptr)
    complete = (pos + 1) // RATIO
    # the largest bit pattern t with at least TOPK scores >= t: the k-th best score (0 if fewer blocks)
    threshold = 0
    for bit in tl.static_range(30, -1, -1):
        candidate = threshold | (1 << bit)
        threshold = tl.where(_count_at_least(scores_ptr, complete, candidate, CHUNK) >= TOPK, candidate, threshold)
    ties = TOPK - _count_at_least(scores_ptr, complete, threshold + 1, CHUNK)  # taken at the threshold itself
    o = tl.arange(0, RATIO_P)
    chosen = tl.zeros((), tl.int32)
    tied = tl.zeros((), tl.int32)
    for b0 in range(0, complete, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        bits = tl.load(scores_ptr + b, mask=b < complete, other=-1.0).to(tl.int32, bitcast=True)
        at = bits == threshold
        tie_rank = tied + tl.cumsum(at.to(tl.int32), axis=0) - at.to(tl.int32)
        take = (bits > threshold) | (at & (tie_rank < ties))
        rank = chosen + tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32)
        tl.store(rows_ptr + rank[:, None] * RATIO + o[None, :], (b[:, None] * RATIO + o[None, :]).to(tl.int64),
                 mask=take[:, None] & (o < RATIO)[None, :])
        chosen += tl.sum(take.to(tl.int32), axis=0)
        tied += tl.sum(at.to(tl.int32), axis=0)
    for j0 in range(chosen * RATIO, TOPK * RATIO, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + j, tl.full((CHUNK,), -1, tl.int64), mask=j < TOPK * RATIO)
    tail = complete * RATIO + o
    tl.store(rows_ptr + TOPK * RATIO + o, tl.where(tail <= pos, tail, -1).to(tl.int64), mask=o < RATIO - 1)
