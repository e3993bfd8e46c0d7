"""Gathering and decoding rows of a PLE n-gram table, one program per row id. The table is read in place by byte
address, so it may sit in device memory or in pinned host memory (read over PCIe through unified addressing)."""

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
