"""Quantized expert records dequantized into bf16 records, for a prefill that runs the bf16 tiles on them: the
fused Q4 tiles serialise dequantization and MMA in each K step (NOTES, session 16), at half the bf16 rate."""

import triton
import triton.language as tl

from moestream.kernels.triton.expert_mlp import record_base, tile_affine, weight_tile


@triton.jit
def _rows(base, out, off_w, off_h, off_s, off_b, rows, code_mask, K: tl.constexpr, BITS: tl.constexpr,
          GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows `rows` of one [N, K] weight, dequantized as the fused tiles' unpack 2 does, rounded to bf16."""
    for k0 in range(0, K, BK):
        s, b = tile_affine(base, off_s, off_b, rows, k0, K, BITS, GROUP, BK)
        w = weight_tile(base, off_w, off_h, s, b, rows, k0, code_mask, K, BITS, GROUP, BN, BK, 2)
        tl.store(out + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :], w.to(tl.bfloat16))


@triton.jit
def dequantize_kernel(addr_ptr, out_ptr, out_stride, off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us,
                      off_ub, off_dw, off_dh, off_ds, off_db, out_gate, out_up, out_down, code_mask,
                      H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
                      BK_H: tl.constexpr, BK_I: tl.constexpr):
    """Record addr[program_id(0)] into bf16 record program_id(0) of `out_ptr` (records `out_stride` bytes apart,
    fields at byte offsets out_gate/up/down): one launch for the three weights, BN rows a program (gate's
    I / BN blocks, then up's, then down's H / BN)."""
    r = tl.program_id(0)
    block = tl.program_id(1)
    base = record_base(addr_ptr, r)
    out = out_ptr + r.to(tl.int64) * out_stride
    if block < 2 * (I // BN):
        up = block >= I // BN
        rows = (block - up * (I // BN)) * BN + tl.arange(0, BN)
        if up:
            _rows(base, (out + out_up).to(tl.pointer_type(tl.bfloat16)), off_uw, off_uh, off_us, off_ub, rows,
                  code_mask, H, BITS, GROUP, BN, BK_H)
        else:
            _rows(base, (out + out_gate).to(tl.pointer_type(tl.bfloat16)), off_gw, off_gh, off_gs, off_gb, rows,
                  code_mask, H, BITS, GROUP, BN, BK_H)
    else:
        rows = (block - 2 * (I // BN)) * BN + tl.arange(0, BN)
        _rows(base, (out + out_down).to(tl.pointer_type(tl.bfloat16)), off_dw, off_dh, off_ds, off_db, rows,
              code_mask, I, BITS, GROUP, BN, BK_I)
