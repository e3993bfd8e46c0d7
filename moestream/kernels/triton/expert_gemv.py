"""The routed-expert MLP for decode: GEMVs over each routing entry's record, read by address (as in
expert_mlp.py), codes turned into floats in place and never unpacked into a tile."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moestream.kernels.triton.codes import q3_nibbles
from moestream.kernels.triton.expert_mlp import group_affine, record_base


@triton.jit
def _field(w, SHIFT: tl.constexpr, mask):
    """(w shifted left by SHIFT, right when negative) & mask."""
    if SHIFT >= 0:
        return (w << SHIFT) & mask
    else:
        return (w >> (-SHIFT)) & mask


@triton.jit
def _gemv_load(base, off_w, off_h, n, k0, K: tl.constexpr, BITS: tl.constexpr, BK: tl.constexpr,
               LIMIT: tl.constexpr):
    """The weight bits of columns k0..k0+BK of rows n (of K), zeros from column LIMIT on, nothing read there:
    bf16 values [BN, BK], or code words [BN, BK // PER] and Q3's high-bit half-words (the words again when there
    are none)."""
    if BITS == 16:
        k = k0 + tl.arange(0, BK)
        words = tl.load((base + off_w).to(tl.pointer_type(tl.bfloat16)) + n[:, None] * K + k[None, :],
                        mask=k[None, :] < LIMIT, other=0)
        high = words
    else:
        WBITS: tl.constexpr = 2 if BITS == 3 else BITS  # Q3's `_w` plane holds its low two bits
        PER: tl.constexpr = 32 // WBITS
        wc = k0 // PER + tl.arange(0, BK // PER)
        live = wc[None, :] < LIMIT // PER
        words = tl.load((base + off_w).to(tl.pointer_type(tl.int32)) + n[:, None] * (K // PER) + wc[None, :],
                        mask=live, other=0)
        if BITS == 3:  # the high bits of word wc's 16 codes are 16-bit word wc of the `_h` plane (little-endian)
            high = tl.load((base + off_h).to(tl.pointer_type(tl.int16)) + n[:, None] * (K // 16) + wc[None, :],
                           mask=live, other=0).to(tl.int32)
        else:
            high = words
    return words, high


@triton.jit
def _gemv_acc(acc, words, high, base, off_s, off_b, n, vec_ptr, k0, field_mask, K: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc += W[n, k] * v[k] over columns k0..k0+BK from `_gemv_load`'s bits: [BN, BK] products for bf16,
    per-group sums for codes."""
    if BITS == 16:
        k = k0 + tl.arange(0, BK)
        acc += words.to(tl.float32) * tl.load(vec_ptr + k, mask=k < K, other=0).to(tl.float32)[None, :]
    else:
        acc += _codes_dot(words, high, base, off_s, off_b, n, vec_ptr, k0, field_mask, K, BITS, GROUP, BN, BK)
    return acc


@triton.jit
def _span_sum(words, high, base, off_s, off_b, n, vec_ptr, k0, field_mask, K: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN]: W[n, k] * v[k] summed over columns k0..k0+BK, from `_gemv_load`'s bits."""
    W: tl.constexpr = BK if BITS == 16 else BK // GROUP
    acc = _gemv_acc(tl.zeros((BN, W), dtype=tl.float32), words, high, base, off_s, off_b, n, vec_ptr, k0, field_mask,
                    K, BITS, GROUP, BN, BK)
    return tl.sum(acc, axis=1)


@triton.jit
def _position(c: tl.constexpr, BITS: tl.constexpr):
    """(shift, mantissa bit) for code c of a word in `_placed`: codes already in the window [LOW, TOP] stay;
    the others go in runs of RUN codes, one shift of the word per run."""
    TOP: tl.constexpr = 23 - BITS
    LOW: tl.constexpr = TOP - 8  # the code's 2**e is at most 2**8: ~2**-15 of the term is left after it cancels
    RUN: tl.constexpr = (TOP - LOW) // BITS + 1
    FIRST: tl.constexpr = (LOW + BITS - 1) // BITS  # the codes FIRST..LAST sit in the window unshifted
    LAST: tl.constexpr = TOP // BITS
    if c < FIRST:  # runs counted down from FIRST - 1, each run's last code at TOP
        SHIFT: tl.constexpr = TOP - BITS * (FIRST - 1 - (FIRST - 1 - c) // RUN * RUN)
    elif c <= LAST:
        SHIFT: tl.constexpr = 0
    else:  # runs counted up from LAST + 1, each run's first code at LOW
        SHIFT: tl.constexpr = LOW - BITS * (LAST + 1 + (c - LAST - 1) // RUN * RUN)
    return SHIFT, BITS * c + SHIFT


@triton.jit
def _placed(words, c: tl.constexpr, BITS: tl.constexpr, field_mask):
    """Code c of each word as the fp32 2**e + q / 2**BITS (e = 23 - BITS - p for the code's mantissa bit p, so
    every code weighs the same) with no int->float conversion; shared shifts serve several codes (`_position`).
    `field_mask` (the code mask at bits TOP..) arrives at run time so that ptxas fuses mask and exponent."""
    SHIFT, P = _position(c, BITS)
    bits = _field(words, SHIFT, field_mask >> (23 - BITS - P))  # shifted right: LLVM learns nothing of its bits
    return (bits | ((127 + 23 - BITS - P) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _offset_of(c: tl.constexpr, BITS: tl.constexpr):
    """2**e of code c in `_placed`: what sum(f v) carries beyond sum(q v) / 2**BITS."""
    SHIFT, P = _position(c, BITS)
    return (1 << (23 - BITS - P)) * 1.0


@triton.jit
def _codes_dot(words, high, base, off_s, off_b, n, vec_ptr, k0, field_mask, K: tl.constexpr, BITS: tl.constexpr,
               GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK // GROUP] per-group sums of W[n, k] * v[k] over columns k0..k0+BK.

    Codes become floats without int->float conversions (`_placed`; Q3's two planes first become Q4-style
    nibbles, `_q3_nibbles`); scale and bias then apply once per group."""
    WBITS: tl.constexpr = 2 if BITS == 3 else BITS
    PER: tl.constexpr = 32 // WBITS
    PLACED: tl.constexpr = 4 if BITS == 3 else BITS  # the width `_placed` reads codes at
    CODES: tl.constexpr = 32 // PLACED  # codes in one placed word
    BKW: tl.constexpr = BK // PER
    wc = k0 // PER + tl.arange(0, BKW)
    live = wc < K // PER
    pairs = vec_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    dot = tl.zeros((BN, BKW), dtype=tl.float32)
    vsum = tl.zeros((BKW,), dtype=tl.float32)
    offset = tl.zeros((BKW,), dtype=tl.float32)  # sum of 2**e v: what sum(f v) holds beyond sum(q v) / 2**PLACED
    pair = tl.zeros((BKW,), dtype=tl.int32)  # two bf16 values of `vec_ptr`, loaded at even codes
    for half in tl.static_range(PER // CODES):
        placed = q3_nibbles(words, high, half) if BITS == 3 else words
        for c in tl.static_range(CODES):
            code = half * CODES + c  # the code's place in its `words` word
            if vec_ptr.dtype.element_ty == tl.bfloat16:  # two values per 32-bit load
                if code % 2 == 0:
                    pair = tl.load(pairs + (wc * PER + code) // 2, mask=live, other=0)
                    v = (pair << 16).to(tl.float32, bitcast=True)
                else:
                    v = (pair & -65536).to(tl.float32, bitcast=True)
            else:
                v = tl.load(vec_ptr + wc * PER + code, mask=live, other=0).to(tl.float32)
            dot += _placed(placed, c, PLACED, field_mask) * v[None, :]
            offset += v * _offset_of(c, PLACED)
            vsum += v
    G: tl.constexpr = BK // GROUP
    dot = tl.sum(tl.reshape(dot, (BN, G, GROUP // PER)), axis=2)
    vsum = tl.sum(tl.reshape(vsum, (G, GROUP // PER)), axis=1)
    offset = tl.sum(tl.reshape(offset, (G, GROUP // PER)), axis=1)
    g = k0 // GROUP + tl.arange(0, G)
    s, b = group_affine(base, off_s, off_b, n[:, None] * (K // GROUP) + g[None, :], BITS, g[None, :] < K // GROUP)
    return s * (1 << PLACED) * (dot - offset[None, :]) + b * vsum[None, :]


@triton.jit
def _program(entries_ptr, records_ptr, INDIRECT: tl.constexpr):
    """(program index i, its output block, entries[i], its record's table index: records[i] when INDIRECT, else i)."""
    i = tl.program_id(0)
    return i, tl.program_id(1), tl.load(entries_ptr + i), tl.load(records_ptr + i) if INDIRECT else i


@triton.jit
def gate_up_rows(xrow, base, n, off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us, off_ub, field_mask,
                 H: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPAN: tl.constexpr, AHEAD: tl.constexpr, TAIL1: tl.constexpr, TAIL2: tl.constexpr):
    """[BN] fp32: silu(xrow @ gate[n].T) * (xrow @ up[n].T) for the record at `base`.

    AHEAD (0 to 3) chunks load before chunk k0 computes (Triton's pipeliner leaves loads that feed no tl.dot
    alone): a program's code loop takes every word of its chunk for each code position, so it computes only
    once the whole chunk is in, and chunks loaded ahead are what arrives meanwhile. The chunk loop covers columns
    0..SPAN (a multiple of BK, masked past H); the columns past SPAN go in parts of TAIL1 and TAIL2 (0: none),
    loaded with the first chunk."""
    W: tl.constexpr = BK if BITS == 16 else BK // GROUP
    MAIN: tl.constexpr = SPAN if SPAN < H else H  # zeros from here on, nothing read
    if TAIL1 > 0:
        g1w, g1h = _gemv_load(base, off_gw, off_gh, n, SPAN, H, BITS, TAIL1, H)
        u1w, u1h = _gemv_load(base, off_uw, off_uh, n, SPAN, H, BITS, TAIL1, H)
    if TAIL2 > 0:
        g2w, g2h = _gemv_load(base, off_gw, off_gh, n, SPAN + TAIL1, H, BITS, TAIL2, H)
        u2w, u2h = _gemv_load(base, off_uw, off_uh, n, SPAN + TAIL1, H, BITS, TAIL2, H)
    acc_g = tl.zeros((BN, W), dtype=tl.float32)
    acc_u = tl.zeros((BN, W), dtype=tl.float32)
    if AHEAD > 0:  # chunks past SPAN load as zeros, reading nothing
        gw, gh = _gemv_load(base, off_gw, off_gh, n, 0, H, BITS, BK, MAIN)
        uw, uh = _gemv_load(base, off_uw, off_uh, n, 0, H, BITS, BK, MAIN)
        if AHEAD > 1:
            gw1, gh1 = _gemv_load(base, off_gw, off_gh, n, BK, H, BITS, BK, MAIN)
            uw1, uh1 = _gemv_load(base, off_uw, off_uh, n, BK, H, BITS, BK, MAIN)
        if AHEAD > 2:
            gw2, gh2 = _gemv_load(base, off_gw, off_gh, n, 2 * BK, H, BITS, BK, MAIN)
            uw2, uh2 = _gemv_load(base, off_uw, off_uh, n, 2 * BK, H, BITS, BK, MAIN)
        for k0 in range(0, SPAN, BK):
            gwn, ghn = _gemv_load(base, off_gw, off_gh, n, k0 + AHEAD * BK, H, BITS, BK, MAIN)
            uwn, uhn = _gemv_load(base, off_uw, off_uh, n, k0 + AHEAD * BK, H, BITS, BK, MAIN)
            acc_g = _gemv_acc(acc_g, gw, gh, base, off_gs, off_gb, n, xrow, k0, field_mask, H, BITS, GROUP, BN, BK)
            acc_u = _gemv_acc(acc_u, uw, uh, base, off_us, off_ub, n, xrow, k0, field_mask, H, BITS, GROUP, BN, BK)
            if AHEAD == 1:
                gw, gh, uw, uh = gwn, ghn, uwn, uhn
            elif AHEAD == 2:
                gw, gh, uw, uh, gw1, gh1, uw1, uh1 = gw1, gh1, uw1, uh1, gwn, ghn, uwn, uhn
            else:
                gw, gh, uw, uh, gw1, gh1, uw1, uh1 = gw1, gh1, uw1, uh1, gw2, gh2, uw2, uh2
                gw2, gh2, uw2, uh2 = gwn, ghn, uwn, uhn
    else:
        for k0 in range(0, SPAN, BK):
            gw, gh = _gemv_load(base, off_gw, off_gh, n, k0, H, BITS, BK, MAIN)
            uw, uh = _gemv_load(base, off_uw, off_uh, n, k0, H, BITS, BK, MAIN)
            acc_g = _gemv_acc(acc_g, gw, gh, base, off_gs, off_gb, n, xrow, k0, field_mask, H, BITS, GROUP, BN, BK)
            acc_u = _gemv_acc(acc_u, uw, uh, base, off_us, off_ub, n, xrow, k0, field_mask, H, BITS, GROUP, BN, BK)
    g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    if TAIL1 > 0:
        g += _span_sum(g1w, g1h, base, off_gs, off_gb, n, xrow, SPAN, field_mask, H, BITS, GROUP, BN, TAIL1)
        u += _span_sum(u1w, u1h, base, off_us, off_ub, n, xrow, SPAN, field_mask, H, BITS, GROUP, BN, TAIL1)
    if TAIL2 > 0:
        k2: tl.constexpr = SPAN + TAIL1
        g += _span_sum(g2w, g2h, base, off_gs, off_gb, n, xrow, k2, field_mask, H, BITS, GROUP, BN, TAIL2)
        u += _span_sum(u2w, u2h, base, off_us, off_ub, n, xrow, k2, field_mask, H, BITS, GROUP, BN, TAIL2)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def down_rows(hrow, base, n, off_dw, off_dh, off_ds, off_db, field_mask, I: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr, AHEAD: tl.constexpr,
              TAIL1: tl.constexpr, TAIL2: tl.constexpr, WAIT: tl.constexpr):
    """[BN] fp32: hrow @ down[n].T (SPAN, AHEAD, TAIL1/2 as in gate_up_rows). With WAIT (a programmatic dependent
    launch) the first chunk's weights load before h, the kernel before's output, is awaited."""
    W: tl.constexpr = BK if BITS == 16 else BK // GROUP
    MAIN: tl.constexpr = SPAN if SPAN < I else I
    acc = tl.zeros((BN, W), dtype=tl.float32)
    dw, dh = _gemv_load(base, off_dw, off_dh, n, 0, I, BITS, BK, MAIN)
    if AHEAD > 1:
        dw1, dh1 = _gemv_load(base, off_dw, off_dh, n, BK, I, BITS, BK, MAIN)
    if AHEAD > 2:
        dw2, dh2 = _gemv_load(base, off_dw, off_dh, n, 2 * BK, I, BITS, BK, MAIN)
    if TAIL1 > 0:
        d1w, d1h = _gemv_load(base, off_dw, off_dh, n, SPAN, I, BITS, TAIL1, I)
    if TAIL2 > 0:
        d2w, d2h = _gemv_load(base, off_dw, off_dh, n, SPAN + TAIL1, I, BITS, TAIL2, I)
    if WAIT:
        gdc_wait()
    for k0 in range(0, SPAN, BK):
        if AHEAD > 0:  # AHEAD chunks in flight while this one computes (past SPAN: masked, nothing read)
            dwn, dhn = _gemv_load(base, off_dw, off_dh, n, k0 + AHEAD * BK, I, BITS, BK, MAIN)
            acc = _gemv_acc(acc, dw, dh, base, off_ds, off_db, n, hrow, k0, field_mask, I, BITS, GROUP, BN, BK)
            if AHEAD == 1:
                dw, dh = dwn, dhn
            elif AHEAD == 2:
                dw, dh, dw1, dh1 = dw1, dh1, dwn, dhn
            else:
                dw, dh, dw1, dh1, dw2, dh2 = dw1, dh1, dw2, dh2, dwn, dhn
        else:
            acc = _gemv_acc(acc, dw, dh, base, off_ds, off_db, n, hrow, k0, field_mask, I, BITS, GROUP, BN, BK)
            if k0 + BK < SPAN:
                dw, dh = _gemv_load(base, off_dw, off_dh, n, k0 + BK, I, BITS, BK, MAIN)
    y = tl.sum(acc, axis=1)
    if TAIL1 > 0:
        y += _span_sum(d1w, d1h, base, off_ds, off_db, n, hrow, SPAN, field_mask, I, BITS, GROUP, BN, TAIL1)
    if TAIL2 > 0:
        y += _span_sum(d2w, d2h, base, off_ds, off_db, n, hrow, SPAN + TAIL1, field_mask, I, BITS, GROUP, BN, TAIL2)
    return y


@triton.jit
def gate_up_gemv_kernel(x_ptr, h_ptr, entries_ptr, tile_addr_ptr, records_ptr, bits_ptr, off_gw, off_gh, off_gs,
                        off_gb, off_uw, off_uh, off_us, off_ub, field_mask, moff_gw, moff_gh, moff_gs, moff_gb,
                        moff_uw, moff_uh, moff_us, moff_ub, miss_field_mask, H: tl.constexpr, I: tl.constexpr,
                        TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, SPAN: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr,
                        INDIRECT: tl.constexpr, SELECT: tl.constexpr, TAIL1: tl.constexpr, TAIL2: tl.constexpr,
                        MISS_BITS: tl.constexpr, MISS_BK: tl.constexpr, MISS_SPAN: tl.constexpr,
                        MISS_TAIL1: tl.constexpr, MISS_TAIL2: tl.constexpr):
    """Decode, program i = routing entry e = entries[i]: h[i] = silu(x[e // TOP_K] @ gate.T) * (... @ up.T).

    PDL lets the down kernel start early (programmatic dependent launch), to read its weights while this one
    runs. INDIRECT: program i's record address is
    tile_addr[records[i]] (a layer's address table indexed by expert id). SELECT (mixed precision, INDIRECT): only
    the entries whose record has bits_ptr[records[i]] == BITS; another launch computes the others, unless MISS_BITS
    names their bits: then this launch computes them too, with the miss layout's offsets (`moff_*`, its field mask
    and chunks). SPAN, AHEAD, TAIL1/2: `gate_up_rows`."""
    if PDL:
        gdc_launch_dependents()
    i, pid_n, e, record = _program(entries_ptr, records_ptr, INDIRECT)
    n = pid_n * BN + tl.arange(0, BN)
    x = x_ptr + (e // TOP_K) * H
    if SELECT:
        bits = tl.load(bits_ptr + record)
        if MISS_BITS > 0:
            if bits == MISS_BITS:
                h = gate_up_rows(x, record_base(tile_addr_ptr, record), n, moff_gw, moff_gh, moff_gs, moff_gb, moff_uw,
                                 moff_uh, moff_us, moff_ub, miss_field_mask, H, MISS_BITS, GROUP, BN, MISS_BK,
                                 MISS_SPAN, AHEAD, MISS_TAIL1, MISS_TAIL2)
                tl.store(h_ptr + i * I + n, h.to(h_ptr.dtype.element_ty))
                return
        else:
            if bits != BITS:
                return
    h = gate_up_rows(x, record_base(tile_addr_ptr, record), n, off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us,
                     off_ub, field_mask, H, BITS, GROUP, BN, BK, SPAN, AHEAD, TAIL1, TAIL2)
    tl.store(h_ptr + i * I + n, h.to(h_ptr.dtype.element_ty))


@triton.jit
def down_gemv_kernel(h_ptr, y_ptr, entries_ptr, tile_addr_ptr, records_ptr, bits_ptr, off_dw, off_dh, off_ds,
                     off_db, field_mask, moff_dw, moff_dh, moff_ds, moff_db, miss_field_mask, H: tl.constexpr,
                     I: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPAN: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr, INDIRECT: tl.constexpr,
                     SELECT: tl.constexpr, TAIL1: tl.constexpr, TAIL2: tl.constexpr, MISS_BITS: tl.constexpr,
                     MISS_BK: tl.constexpr, MISS_SPAN: tl.constexpr, MISS_TAIL1: tl.constexpr,
                     MISS_TAIL2: tl.constexpr):
    """Decode: y[entries[i]] = h[i] @ down.T (SPAN, AHEAD, INDIRECT, SELECT, TAIL1/2, MISS_* as in
    gate_up_gemv_kernel). Launched with PDL it may start before gate_up has finished: the first chunk's weights load
    before it waits for h."""
    i, pid_n, e, record = _program(entries_ptr, records_ptr, INDIRECT)
    n = pid_n * BN + tl.arange(0, BN)
    if SELECT:
        bits = tl.load(bits_ptr + record)
        if MISS_BITS > 0:
            if bits == MISS_BITS:
                y = down_rows(h_ptr + i * I, record_base(tile_addr_ptr, record), n, moff_dw, moff_dh, moff_ds,
                              moff_db, miss_field_mask, I, MISS_BITS, GROUP, BN, MISS_BK, MISS_SPAN, AHEAD, MISS_TAIL1,
                              MISS_TAIL2, PDL)
                tl.store(y_ptr + e * H + n, y.to(y_ptr.dtype.element_ty))
                return
        else:
            if bits != BITS:
                return
    y = down_rows(h_ptr + i * I, record_base(tile_addr_ptr, record), n, off_dw, off_dh, off_ds, off_db, field_mask,
                  I, BITS, GROUP, BN, BK, SPAN, AHEAD, TAIL1, TAIL2, PDL)
    tl.store(y_ptr + e * H + n, y.to(y_ptr.dtype.element_ty))
