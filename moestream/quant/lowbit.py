"""Q3 and Q2 from Q4 without re-quantizing (Cherenkov's low-bit stores).

q3 = q4 >> 1 and q2 = q4 >> 2, scales and biases kept, reconstructed at the midpoints of the wider bins:
w = (2 q3 + 0.5) s + b and w = (4 q2 + 1.5) s + b. That is plain affine with scale m s and bias
b + (m - 1) s / 2, m = 2 ** (4 - bits), which is how the kernels read them.

Packing: Q2 is 16 codes per int32, low bits first. Q3 is two planes, so no code straddles a word: the
low two bits as Q2, then the high bit, 32 per int32.
"""

from __future__ import annotations

import torch

from moestream.quant.affine import unpack_codes


def effective_affine(scales: torch.Tensor, biases: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, bias) that reconstruct `bits`-bit codes derived from Q4 at their bin midpoints."""
    m = float(1 << (4 - bits))
    s = scales.float()
    return s * m, biases.float() + s * (m - 1) / 2


def derive_codes(q4_words: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Q4 words [..., in/8] -> the packed planes of the `bits`-bit record ([lo] for Q2, [lo, hi] for Q3),
    word by word: each Q4 word's 8 codes give up their top `bits` bits, with no unpacking to codes."""
    if bits == 2:
        return [_gather(q4_words, 2, 2)]
    if bits == 3:
        return [_gather(q4_words, 1, 2), _gather(q4_words, 3, 1)]
    raise ValueError(f"no {bits}-bit derivation")


def _gather(q4_words: torch.Tensor, low_bit: int, width: int) -> torch.Tensor:
    """Bits low_bit..low_bit+width of every Q4 code, packed `32 // width` to an int32, low codes first."""
    w = q4_words.to(torch.int64) & 0xFFFFFFFF
    field = torch.zeros_like(w)  # each Q4 word's 8 fields side by side: 8 * width bits
    for i in range(8):
        field |= ((w >> (4 * i + low_bit)) & ((1 << width) - 1)) << (width * i)
    per_out = 32 // (8 * width)  # Q4 words per output word
    field = field.unflatten(-1, (-1, per_out))
    out = torch.zeros_like(field[..., 0])
    for j in range(per_out):
        out |= field[..., j] << (8 * width * j)
    return (out - ((out >> 31) << 32)).to(torch.int32)  # unsigned 32-bit -> the int32 with the same bits


def unpack_lowbit(planes: list[torch.Tensor], bits: int) -> torch.Tensor:
    codes = unpack_codes(planes[0], 2)
    if bits == 3:
        codes = codes | (unpack_codes(planes[1], 1) << 2)
    return codes


def dequantize_lowbit(planes: list[torch.Tensor], scales: torch.Tensor, biases: torch.Tensor, bits: int,
                      group_size: int = 64) -> torch.Tensor:
    codes = unpack_lowbit(planes, bits).float()
    out, inp = codes.shape
    s, b = effective_affine(scales, biases, bits)
    w = codes.view(out, inp // group_size, group_size) * s[..., None] + b[..., None]
    return w.view(out, inp)
