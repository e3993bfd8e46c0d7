"""The routed-expert MLP for prefill (tensor-core tiles), reading each expert's weights from its record by address.

A launch covers tiles; tile t is one expert (record at byte address `tile_addr[t]`, in the GPU pool,
the ring, or mapped pinned host memory) applied to `tile_count[t]` routing entries starting at
`tile_start[t]` in `entries` (flat row * TOP_K + k indices). Q4 weights are dequantized in registers
(MLX affine: 8 codes per int32, low nibble first, bf16 scale and bias per group of 64).
"""

import triton
import triton.language as tl

from moestream.kernels.triton.codes import joined_codes


@triton.jit
def group_affine(base, off_s, off_b, g, BITS: tl.constexpr, live=None):
    """Scale and bias at group indices `g` (zeros where not `live`); Q3/Q2 codes (derived from Q4) sit at their
    bins' midpoints."""
    if live is None:
        s = tl.load((base + off_s).to(tl.pointer_type(tl.bfloat16)) + g).to(tl.float32)
        b = tl.load((base + off_b).to(tl.pointer_type(tl.bfloat16)) + g).to(tl.float32)
    else:
        s = tl.load((base + off_s).to(tl.pointer_type(tl.bfloat16)) + g, mask=live, other=0).to(tl.float32)
        b = tl.load((base + off_b).to(tl.pointer_type(tl.bfloat16)) + g, mask=live, other=0).to(tl.float32)
    if BITS < 4:
        m: tl.constexpr = 1 << (4 - BITS)
        b = b + s * ((m - 1) / 2)
        s = s * m
    return s, b


@triton.jit
def tile_affine(base, off_s, off_b, rows, k0, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                BK: tl.constexpr):
    """The scales and biases of a weight tile's groups ([BN, max(BK / GROUP, 1)]; unread for bf16)."""
    NG: tl.constexpr = BK // GROUP if BK > GROUP else 1
    g = rows[:, None] * (K // GROUP) + k0 // GROUP + tl.arange(0, NG)[None, :]
    if BITS == 16:  # never used: bf16 tiles have no groups
        s = g.to(tl.float32)
        b = s
    else:
        s, b = group_affine(base, off_s, off_b, g, BITS)
    return s, b


@triton.jit
def weight_tile(base, off_w, off_h, scale, bias, rows, k0, code_mask, K: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A [BN, BK] tile (rows `rows`, columns k0..k0+BK) of an [N, K] weight, dequantized to fp32 with its
    groups' `scale` and `bias` (`tile_affine`). Each code word is loaded once and its codes dequantized in the
    thread that loaded it (`joined_codes`)."""
    if BITS == 16:  # an if/else: the compiler goes on past a constexpr branch's return
        ptr = (base + off_w).to(tl.pointer_type(tl.bfloat16))
        w = tl.load(ptr + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :]).to(tl.float32)
    else:
        NG: tl.constexpr = BK // GROUP if BK > GROUP else 1
        PER: tl.constexpr = 32 // (2 if BITS == 3 else BITS)  # codes a word (Q3's `_w` plane: its low two bits)
        wcols = k0 // PER + tl.arange(0, BK // PER)
        words = tl.load((base + off_w).to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // PER) + wcols[None, :])
        w = joined_codes(words, base, off_h, scale, bias, rows, wcols, code_mask, K, BITS, BN, BK, NG)
    return w


@triton.jit
def record_base(tile_addr_ptr, i):
    """The record at address tile_addr_ptr[i], as a byte pointer. Records and their fields are 64-byte
    aligned (format.py); saying so lets loads from them be vectorised (unknown alignment means 2-byte loads)."""
    return tl.multiple_of(tl.load(tile_addr_ptr + i).to(tl.pointer_type(tl.uint8)), 64)


@triton.jit
def _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM: tl.constexpr):
    """This program's tile: its record's base pointer, first position, the [BM] positions' mask and entries."""
    tile = tl.program_id(0)
    base = record_base(tile_addr_ptr, tile)
    start = tl.load(tile_start_ptr + tile)
    m = tl.arange(0, BM)
    valid = m < tl.load(tile_count_ptr + tile)
    entry = tl.load(entries_ptr + start + m, mask=valid, other=0)
    return base, start + m, valid, entry


@triton.jit
def _product(acc, rows, w, SWAP: tl.constexpr):
    """acc + rows @ w.T ([BM, BN]), or with SWAP acc + w @ rows.T ([BN, BM]): the dequantized weights as the
    MMA's first operand, which Hopper's wgmma takes from registers, and the rows as its N (up to 256 wide)."""
    if SWAP:
        acc = tl.dot(w.to(rows.dtype), tl.trans(rows), acc)
    else:
        acc = tl.dot(rows, tl.trans(w.to(rows.dtype)), acc)
    return acc


@triton.jit
def _store_rows(ptr, out, rows, cols, stride, valid, SWAP: tl.constexpr):
    """out [BM, BN] (or [BN, BM] with SWAP) to ptr[rows[m] * stride + cols[n]] for the valid m."""
    if SWAP:
        tl.store(ptr + rows[None, :] * stride + cols[:, None], out.to(ptr.dtype.element_ty), mask=valid[None, :])
    else:
        tl.store(ptr + rows[:, None] * stride + cols[None, :], out.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _halves(acc, SWAP: tl.constexpr):
    """The gate and up halves of a joined tile's accumulator (its BN rows, or with SWAP its BN columns)."""
    if SWAP:
        BN: tl.constexpr = acc.shape[0]
        parts = tl.permute(tl.reshape(acc, (2, BN // 2, acc.shape[1])), (1, 2, 0))
    else:
        BN: tl.constexpr = acc.shape[1]
        parts = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BN // 2)), (0, 2, 1))
    return tl.split(parts)


@triton.jit
def _rows_by_weight(a_ptr, a_rows, valid, base_w, base_s, off_w, off_h, off_s, off_b, w_rows, code_mask,
                    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SWAP: tl.constexpr):
    """The valid rows a_rows of a [*, K] activation times weight rows w_rows (codes from base_w, scales and biases
    from base_s): [BM, BN], or with SWAP [BN, BM], in fp32."""
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        s, b = tile_affine(base_s, off_s, off_b, w_rows, k0, K, BITS, GROUP, BK)
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + a_rows[:, None] * K + k[None, :], mask=valid[:, None], other=0.0)
        w = weight_tile(base_w, off_w, off_h, s, b, w_rows, k0, code_mask, K, BITS, GROUP, BN, BK)
        acc = _product(acc, a, w, SWAP)
    return acc


@triton.jit
def _joined_gate_up(x_ptr, h_ptr, base, pos, valid, row, off_gw, off_gh, off_gs, off_gb, off_uw, off_us, code_mask,
                    H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr):
    """gate_up_kernel with BN / 2 gate rows and the same up rows in one [BN, BK] weight tile: one MMA a step and
    one accumulator, so 8 warps split the weight rows where separate gate and up tiles split the entries. Each
    row's base moves to the up fields for the second half (no Q3: its high-bit plane moves by another distance)."""
    HALF: tl.constexpr = BN // 2
    r = tl.arange(0, BN)
    w_rows = tl.program_id(1) * HALF + r % HALF
    base_w = base + tl.where(r >= HALF, off_uw - off_gw, 0)[:, None]
    base_s = base + tl.where(r >= HALF, off_us - off_gs, 0)[:, None]  # biases move as far (format.py)
    acc = _rows_by_weight(x_ptr, row, valid, base_w, base_s, off_gw, off_gh, off_gs, off_gb, w_rows, code_mask, H,
                          BITS, GROUP, BM, BN, BK, SWAP)
    g, u = _halves(acc, SWAP)
    n = tl.program_id(1) * HALF + tl.arange(0, HALF)
    _store_rows(h_ptr, g / (1.0 + tl.exp(-g)) * u, pos, n, I, valid, SWAP)


@triton.jit
def gate_up_kernel(x_ptr, h_ptr, entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr,
                   off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us, off_ub, code_mask,
                   H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, JOIN: tl.constexpr,
                   SPARSE: tl.constexpr):
    """h[p, :] = silu(x[row] @ gate.T) * (x[row] @ up.T) for the entries p of each tile (JOIN: `_joined_gate_up`;
    SPARSE: a tile of no entries exits)."""
    if SPARSE:
        if tl.load(tile_count_ptr + tl.program_id(0)) == 0:
            return
    base, pos, valid, entry = _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM)
    row = entry // TOP_K
    if JOIN:
        _joined_gate_up(x_ptr, h_ptr, base, pos, valid, row, off_gw, off_gh, off_gs, off_gb, off_uw, off_us,
                        code_mask, H, I, BITS, GROUP, BM, BN, BK, SWAP)
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    if SWAP:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k0 in range(0, H, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + row[:, None] * H + k[None, :], mask=valid[:, None], other=0.0)
        x = x.to(x_ptr.dtype.element_ty)
        gs, gb = tile_affine(base, off_gs, off_gb, n, k0, H, BITS, GROUP, BK)
        g = weight_tile(base, off_gw, off_gh, gs, gb, n, k0, code_mask, H, BITS, GROUP, BN, BK)
        acc_g = _product(acc_g, x, g, SWAP)
        us, ub = tile_affine(base, off_us, off_ub, n, k0, H, BITS, GROUP, BK)
        u = weight_tile(base, off_uw, off_uh, us, ub, n, k0, code_mask, H, BITS, GROUP, BN, BK)
        acc_u = _product(acc_u, x, u, SWAP)
    _store_rows(h_ptr, acc_g / (1.0 + tl.exp(-acc_g)) * acc_u, pos, n, I, valid, SWAP)


@triton.jit
def down_kernel(h_ptr, y_ptr, entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr,
                off_dw, off_dh, off_ds, off_db, code_mask,
                H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, SPARSE: tl.constexpr):
    """y[entry, :] = h[p, :] @ down.T, written once per routing entry (no atomics; SPARSE as gate_up_kernel's)."""
    if SPARSE:
        if tl.load(tile_count_ptr + tl.program_id(0)) == 0:
            return
    base, pos, valid, entry = _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = _rows_by_weight(h_ptr, pos, valid, base, base, off_dw, off_dh, off_ds, off_db, n, code_mask, I, BITS, GROUP,
                          BM, BN, BK, SWAP)
    _store_rows(y_ptr, acc, entry, n, H, valid, SWAP)
