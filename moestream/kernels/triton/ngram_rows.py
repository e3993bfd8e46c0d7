"""Hashing tokens to the rows of a PLE n-gram table (a program a token), and gathering and decoding those rows (a
program a row id). The table is read in place by byte address, so it may sit in device memory or in pinned host
memory (read over PCIe through unified addressing)."""

import triton
import triton.language as tl


@triton.jit
def ngram_rows_kernel(table_base, row_stride, rows, ids_ptr, out_ptr, DIM: tl.constexpr, Q4: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = row ids[i] of the table, decoded in fp32: bf16 values, or MLX q4 `w | s | b` (codes low nibble
    first, a bf16 scale and bias per group, `scale * code + bias`). An id outside [0, rows) reads nothing and
    gives a zero row, so a bad id cannot fault the context."""
    i = tl.program_id(0).to(tl.int64)
    row_id = tl.load(ids_ptr + i).to(tl.int64)  # tables span tens of GB: byte offsets need 64 bits
    d = tl.arange(0, BLOCK)
    live = (d < DIM) & (row_id >= 0) & (row_id < rows)
    row = table_base + row_id * row_stride
    if Q4:
        GROUPS: tl.constexpr = DIM // GROUP
        code_bytes = tl.load((row + d // 2).to(tl.pointer_type(tl.uint8)), mask=live, other=0).to(tl.int32)
        code = (code_bytes >> ((d % 2) * 4)) & 15
        scale = tl.load((row + DIM // 2).to(tl.pointer_type(tl.bfloat16)) + d // GROUP, mask=live, other=0)
        bias = tl.load((row + DIM // 2 + 2 * GROUPS).to(tl.pointer_type(tl.bfloat16)) + d // GROUP, mask=live,
                       other=0)
        # scale * code is exact in fp32 (8 x 4 significant bits), so fused or not this rounds once, as torch does
        value = scale.to(tl.float32) * code.to(tl.float32) + bias.to(tl.float32)
    else:
        value = tl.load(row.to(tl.pointer_type(tl.bfloat16)) + d, mask=live, other=0).to(tl.float32)
    tl.store(out_ptr + i * DIM + d, value.to(out_ptr.dtype.element_ty), mask=d < DIM)


@triton.jit(do_not_specialize=["eos"])
def ngram_ids_kernel(ids_ptr, context_ptr, mult_ptr, sizes_ptr, offsets_ptr, out_ptr, eos, C: tl.constexpr,
                     HPN: tl.constexpr, HEADS: tl.constexpr, N_BLOCK: tl.constexpr, H_BLOCK: tl.constexpr):
    """Token t's row ids out[t, HEADS] (reference.ngram_ids): the ids 0..C places back in context ++ ids, EOS
    for a place back across an EOS or the start, times their multipliers; head h's order m = 2 + h // HPN XORs
    the first m products, and row = hash mod size[h] + offset[h] (int64 wrapping as torch's). `eos` is never
    specialised: a store's EOS id must not pick a kernel."""
    t = tl.program_id(0)
    back = tl.arange(0, N_BLOCK)
    at = C + t - back  # the position `back` places back in context ++ ids
    places = back <= C
    history = tl.where(at < C, tl.load(context_ptr + at, mask=places & (at >= 0) & (at < C), other=0),
                       tl.load(ids_ptr + (at - C), mask=places & (at >= C), other=0)).to(tl.int64)
    # a place back is valid when no EOS lies from it (included) to the token (excluded) and it is not before 0
    crossing = ((history == eos) | (at < 0)) & (back > 0)
    shifted = tl.where(tl.cumsum(crossing.to(tl.int32), 0) > 0, eos, history)
    products = shifted * tl.load(mult_ptr + back, mask=places, other=0)
    h = tl.arange(0, H_BLOCK)
    order = 2 + h // HPN
    mixed = tl.xor_sum(tl.where(back[None, :] < order[:, None], products[None, :], 0), axis=1)
    heads = h < HEADS
    size = tl.load(sizes_ptr + h, mask=heads, other=1)
    row = mixed % size
    row = tl.where(row < 0, row + size, row)  # torch.remainder takes the divisor's sign
    tl.store(out_ptr + t * HEADS + h, row + tl.load(offsets_ptr + h, mask=heads, other=0), mask=heads)
