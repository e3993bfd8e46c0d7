"""A decode step's dense projections: y = W x (+ b) for up to 16 token rows, W [N, K] bf16 read once for all of
them, fp32 accumulation in tensor-core products; with GLU, x = silu(gate) * up (a SwiGLU MLP's down projection),
each rounded to the activation dtype as torch rounds them. Where K is split, the last of a block's programs to
finish sums the parts (one launch, not a GEMV and a reduction: a decode step ran three such pairs a layer). A
router's launch also routes: the last block to finish turns the rows' logits into top-k weights and ids (one
launch, not two)."""

import triton
import triton.language as tl

from moestream.kernels.triton.rowwise import top_k_rows


@triton.jit
def dense_rows_kernel(x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, part_ptr, arrivals_ptr, route_w_ptr, route_ids_ptr, T, N,
                      stride_x, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                      SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, ROUTE: tl.constexpr,
                      E: tl.constexpr, E_BLOCK: tl.constexpr, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                      NORMALISE: tl.constexpr):
    """Program (i, s): the BN weight rows n of block i for all of the step's token rows, 16 of them with the ones
    past T masked (zeros), over columns s * SPAN .. (s + 1) * SPAN in chunks of BK, one tensor-core product a
    chunk. The weights are read once for every row, and a row's bits do not depend on T: the other rows of the
    tile never meet it in a product (batch invariance). With SPLITS, each program stores its fp32 part and counts
    itself in arrivals[i]; the last to arrive adds the parts in split order (the same bits every run) and resets the
    count for the next launch. With ROUTE, each block's last program counts the block in arrivals[blocks]; the last
    block routes every row from its first E outputs (top_k_rows) into route_w, route_ids [T, TOP_K]."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    live = n < N
    start = tl.program_id(1) * SPAN
    end = tl.minimum(start + SPAN, K)
    rows = tl.arange(0, 16)
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for k0 in range(start, end, BK):
        k = k0 + tl.arange(0, BK)
        inside = (rows < T)[:, None] & (k < end)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=inside, other=0.0)
        if GLU:
            dt = x_ptr.dtype.element_ty
            g = x.to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dt) * tl.load(up_ptr + rows[:, None] * stride_x + k[None, :],
                                                           mask=inside, other=0.0)).to(dt)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & (k < end)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    out = rows[:, None] < T
    mine = out & live[None, :]
    last = True
    if SPLITS > 1:
        tl.store(part_ptr + (tl.program_id(1) * T + rows[:, None]) * N + n[None, :], acc, mask=mine)
        tl.debug_barrier()  # every thread's part is stored before the count that releases it
        last = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel") == SPLITS - 1
        if last:
            acc = tl.zeros((16, BN), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(part_ptr + (s * T + rows[:, None]) * N + n[None, :], mask=mine, other=0.0,
                               cache_modifier=".cg")
            tl.store(arrivals_ptr + tl.program_id(0), 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mine)
        if ROUTE:
            blocks = tl.num_programs(0)
            tl.debug_barrier()  # the block's outputs are stored before the count that releases them
            if tl.atomic_add(arrivals_ptr + blocks, 1, sem="acq_rel") == blocks - 1:
                e = tl.arange(0, E_BLOCK)[None, :]
                logits = tl.load(y_ptr + rows[:, None] * N + e, mask=out & (e < E), other=float("-inf"),
                                 cache_modifier=".cg").to(tl.float32)
                chosen_p, chosen_e = top_k_rows(logits, E, E_BLOCK, TOP_K, K_BLOCK, NORMALISE, 16)
                slot = tl.arange(0, K_BLOCK)[None, :]
                keep = out & (slot < TOP_K)
                tl.store(route_w_ptr + rows[:, None] * TOP_K + slot, chosen_p.to(route_w_ptr.dtype.element_ty),
                         mask=keep)
                tl.store(route_ids_ptr + rows[:, None] * TOP_K + slot, chosen_e, mask=keep)
                tl.store(arrivals_ptr + blocks, 0)
