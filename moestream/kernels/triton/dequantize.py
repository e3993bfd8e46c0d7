"""Quantized expert records dequantized into bf16 records, for a prefill that runs the bf16 tiles on them: the
fused Q4 tiles serialise dequantization and MMA in each K step (NOTES, session 16), at half the bf16 rate."""

import triton
import triton.language as tl

from moestream.kernels.triton.expert_mlp import record_base, tile_affine, weight_tile


@triton.jit
def dequantize_kernel(addr_ptr, out_ptr, out_stride, off_w, off_h, off_s, off_b, off_out, code_mask,
                      K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows BN * program_id(1) .. of one [N, K] weight of record addr[program_id(0)], into the same weight's
    field (at byte `off_out`) of bf16 record program_id(0) of `out_ptr` (records `out_stride` bytes apart): the
    values the fused prefill tiles compute, q * s + b in fp32 rounded to bf16."""
    r = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    base = record_base(addr_ptr, r)
    out = (out_ptr + r.to(tl.int64) * out_stride + off_out).to(tl.pointer_type(tl.bfloat16))
    for k0 in range(0, K, BK):
        s, b = tile_affine(base, off_s, off_b, rows, k0, K, BITS, GROUP, BK)
        w = weight_tile(base, off_w, off_h, s, b, rows, k0, code_mask, K, BITS, GROUP, BN, BK, 1)
        tl.store(out + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :], w.to(tl.bfloat16))
