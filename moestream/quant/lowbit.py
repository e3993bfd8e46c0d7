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
    """Q4 words [..., in/8] -> the packed planes of the `bits`-bit record ([lo] for Q2, [lo, hi] for Q3).
    Byte-wise on uint8 (a Q4 byte holds two codes), so it runs at memory speed on the CPU or a GPU."""
    b = q4_words.contiguous().view(torch.uint8)
    if bits == 2:
        return [_pack_fields(((b >> 2) & 3) | ((b >> 4) & 0xC), 4)]
    if bits == 3:
        return [_pack_fields(((b >> 1) & 3) | ((b >> 3) & 0xC), 4), _pack_fields(((b >> 3) & 1) | ((b >> 6) & 2), 2)]
    raise ValueError(f"no {bits}-bit derivation")


def _pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., n] of `width`-bit fields (a Q4 byte's two codes each) -> int32 words, low fields first."""
    per_byte = 8 // width
    fields = fields.unflatten(-1, (-1, per_byte))
    out = fields[..., 0].clone()
    for j in range(1, per_byte):
        out |= fields[..., j] << (width * j)
    return out.view(torch.int32)


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
