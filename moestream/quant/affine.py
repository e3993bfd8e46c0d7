"""MLX affine quantization: groups of `group_size` along the input dim, `w = scale * q + bias`.

Codes pack 32 // bits per uint32, lowest bits first (bit for bit what MLX writes). `quantize` runs at
pack time only; `dequantize` is the torch reference that the CPU path and the kernel tests use.
"""

from __future__ import annotations

import numpy as np
import torch

SCALE_DTYPE = torch.bfloat16


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[out, in] integer codes in [0, 2**bits) -> [out, in * bits // 32] int32 words, low bits first."""
    per_word = 32 // bits
    out, inp = codes.shape
    assert inp % per_word == 0, f"input dim {inp} is not a multiple of {per_word}"
    c = codes.to(torch.int64).reshape(out, inp // per_word, per_word).numpy().astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    words = np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint32)
    return torch.from_numpy(words.view(np.int32).copy())


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[out, n] int32 words -> [out, n * 32 // bits] int32 codes."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1)


def _round_toward(x: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """Round fp32 `x` to `dtype`, then step one ulp so the result is <= x (down) or >= x (up)."""
    y = x.to(dtype)
    if down:
        return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -float("inf"))), y)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def quantize(
    w: torch.Tensor, bits: int = 4, group_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed int32 [out, in*bits/32], scales [out, in/g], biases [out, in/g]).

    Per group: bias = min rounded down, scale = range / (2**bits - 1) rounded up, so the stored grid
    covers the group and every weight dequantizes within half a step of its source value.
    """
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"input dim {inp} is not a multiple of the group size {group_size}")
    g = w.float().reshape(out, inp // group_size, group_size)
    levels = (1 << bits) - 1
    bias = _round_toward(g.amin(-1), SCALE_DTYPE, down=True)
    span = (g.amax(-1) - bias.float()).clamp_min(0)
    scale = _round_toward(span / levels, SCALE_DTYPE, down=False)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(span))
    q = torch.round((g - bias.float()[..., None]) / safe[..., None]).clamp_(0, levels)
    return pack_codes(q.reshape(out, inp), bits), scale, bias


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int = 4, group_size: int = 64
) -> torch.Tensor:
    """Reference dequantization: -> float32 [out, in]."""
    codes = unpack_codes(packed, bits).float()
    out, inp = codes.shape
    g = codes.reshape(out, inp // group_size, group_size)
    w = g * scales.float()[..., None] + biases.float()[..., None]
    return w.reshape(out, inp)
