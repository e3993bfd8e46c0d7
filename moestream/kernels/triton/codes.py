"""Quantized codes turned into floats in registers, shared by the decode GEMVs and the prefill tiles."""

import triton
import triton.language as tl


@triton.jit
def q3_nibbles(words, high, HALF: tl.constexpr):
    """Codes 8 * HALF .. 8 * HALF + 7 of Q3's planes (two bits each in `words`, one in `high`) as a Q4-style
    word of nibbles, by spreading bit fields in place: ~2 ops a code, where placing each code from both planes
    took ~6 and spilled."""
    lo = (words >> (16 * HALF)) & 0xFFFF
    lo = (lo | (lo << 8)) & 0x00FF00FF
    lo = (lo | (lo << 4)) & 0x0F0F0F0F
    lo = (lo | (lo << 2)) & 0x33333333
    hi = (high >> (8 * HALF)) & 0xFF
    hi = (hi | (hi << 12)) & 0x000F000F
    hi = (hi | (hi << 6)) & 0x03030303
    hi = (hi | (hi << 3)) & 0x11111111
    return lo | (hi << 2)


@triton.jit
def _code_floats(words, i: tl.constexpr, P: tl.constexpr, field, s1, b1):
    """Code i (P bits a code) of each word, dequantized: its bits placed in the mantissa of 1.0 (f = 1 + q / 2**P,
    no int->float conversion), then f * s1 + b1 with s1 = 2**P s and b1 = b - s1."""
    SHIFT: tl.constexpr = 23 - P - P * i
    if SHIFT >= 0:
        bits = (words << SHIFT) & field
    else:
        bits = (words >> (-SHIFT)) & field  # the sign bits it brings in fall outside `field`
    return (bits | 0x3F800000).to(tl.float32, bitcast=True) * s1 + b1


@triton.jit
def _in_order(d0, d1, d2, d3, d4, d5, d6, d7):
    """Eight tensors joined in-thread so that [..., 8] read flat is d0..d7: each join adds the least significant
    place of the flat index, so the outer join takes the even ones, then every fourth, then every eighth."""
    return tl.join(tl.join(tl.join(d0, d4), tl.join(d2, d6)), tl.join(tl.join(d1, d5), tl.join(d3, d7)))


@triton.jit
def _codes(w, FIRST: tl.constexpr, STEP: tl.constexpr, P: tl.constexpr, field, s1, b1):
    """Codes FIRST, FIRST + STEP, .. (eight) of the words `w`, dequantized and joined `_in_order`."""
    return _in_order(_code_floats(w, FIRST, P, field, s1, b1), _code_floats(w, FIRST + STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 2 * STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 3 * STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 4 * STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 5 * STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 6 * STEP, P, field, s1, b1),
                     _code_floats(w, FIRST + 7 * STEP, P, field, s1, b1))


@triton.jit
def joined_codes(words, base, off_h, scale, bias, rows, wcols, code_mask, K: tl.constexpr, BITS: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, NG: tl.constexpr):
    """`weight_tile`'s codes (expert_mlp.py): each word's codes dequantized where the word is, then joined in-thread
    into the [BN, BK] tile (Q3's two planes first become Q4-style nibbles). Spreading a word's codes over the lanes
    by a reshape measured slower: each thread then unpacked one code per word and loaded a scale per code."""
    P: tl.constexpr = 4 if BITS == 3 else BITS  # the width codes are placed at
    field = (code_mask if BITS != 3 else 15) << (23 - P)
    WPG: tl.constexpr = words.shape[1] // NG  # words a group
    s1 = scale * (1 << P)
    b1 = (bias - s1)[:, :, None]
    s1 = s1[:, :, None]
    words = tl.reshape(words, (BN, NG, WPG))
    if BITS == 3:  # 16 codes a word: the even ones, then the odd ones, from the two nibble words of 8
        hptr = (base + off_h).to(tl.pointer_type(tl.int16))
        high = tl.reshape(tl.load(hptr + rows[:, None] * (K // 16) + wcols[None, :]).to(tl.int32), (BN, NG, WPG))
        lo, hi = q3_nibbles(words, high, 0), q3_nibbles(words, high, 1)
        codes = tl.join(_in_order(_code_floats(lo, 0, P, field, s1, b1), _code_floats(lo, 2, P, field, s1, b1),
                                  _code_floats(lo, 4, P, field, s1, b1), _code_floats(lo, 6, P, field, s1, b1),
                                  _code_floats(hi, 0, P, field, s1, b1), _code_floats(hi, 2, P, field, s1, b1),
                                  _code_floats(hi, 4, P, field, s1, b1), _code_floats(hi, 6, P, field, s1, b1)),
                        _in_order(_code_floats(lo, 1, P, field, s1, b1), _code_floats(lo, 3, P, field, s1, b1),
                                  _code_floats(lo, 5, P, field, s1, b1), _code_floats(lo, 7, P, field, s1, b1),
                                  _code_floats(hi, 1, P, field, s1, b1), _code_floats(hi, 3, P, field, s1, b1),
                                  _code_floats(hi, 5, P, field, s1, b1), _code_floats(hi, 7, P, field, s1, b1)))
    elif BITS == 2:
        codes = tl.join(_codes(words, 0, 2, P, field, s1, b1), _codes(words, 1, 2, P, field, s1, b1))
    else:
        codes = _codes(words, 0, 1, P, field, s1, b1)
    return tl.reshape(codes, (BN, BK))
