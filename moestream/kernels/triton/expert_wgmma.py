"""The Q4 routed-expert MLP for prefill on Hopper's warpgroup MMA (Gluon): expert_mlp.py's tiles, with each
weight code dequantized in the register where the MMA reads it.

Triton's kernel (expert_mlp.py) dequantizes a [BN, BK] weight tile where its words were loaded, then moves it
through shared memory into the MMA's operand layout, behind three CTA barriers a K step. Here every thread loads
the code words of its own MMA rows (the four lanes of a quad read the same words, each keeping two codes of each)
and dequantizes straight into the operand while the step before's MMA runs (two queued, operands alternating),
one barrier a step. The entries' rows come through a ring of STAGES (>= 3) shared buffers by async copies.

A program computes weight rows [BN = 16 x num_warps] against up to BM entries (tile_addr / tile_start /
tile_count tables as expert_mlp.py's). Gate/up tiles interleave the two matrices by eight rows, so that each
thread holds a gate and an up value of the same column and entry (the accumulator's rows r and r + 8).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BK = gl.constexpr(64)  # one scale group a K step
FIELD = 0xF << 19  # a code placed in the top of fp32's mantissa (1 + q / 16): passed at run time, so that ptxas
ONE = gl.constexpr(0x3F800000)  # fuses the AND with the OR of ONE into one LOP3


def layouts(bm: int, num_warps: int) -> dict:
    """The kernels' layouts for BN = 16 x num_warps weight rows and BM entries: the code words' [BN, 8 words, 4
    lanes of a quad] (a quad's lanes hold the same words of rows r and r + 8, as the MMA's operand wants its
    rows), the accumulator's, the MMA's first operand's, the entries' rows' copies' [BM, BK], their ring's, and
    the stores' (16-byte runs of output columns)."""
    bn = 16 * num_warps
    warp_rows = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, bm, 16])
    return dict(
        BN=bn,
        WORDS=gl.DistributedLinearLayout(reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [8, 0, 0]],
                                         lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                         warp_bases=warp_rows, block_bases=[], shape=[bn, 8, 4]),
        ACC=acc, A=gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2),
        ROWS=gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[num_warps, 1],
                              order=[1, 0]),
        RING=gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        STORE=gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, num_warps],
                               order=[0, 1]))


@gluon.jit
def _weight_rows(base, off_w, off_s, off_b, off_w2, off_s2, off_b2, first, K: gl.constexpr, BN: gl.constexpr,
                 JOIN: gl.constexpr, WORDS: gl.constexpr):
    """Word pointers [BN, 8, 4] of K step 0 and scale / bias pointers [BN, 1, 1] of the program's weight rows
    from `first`; with JOIN, rows whose bit 3 is set are the same rows of the second matrix (up beside gate)."""
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS)))
    if JOIN:
        second = (r & 8) != 0
        row = first + (r // 16) * 8 + r % 8
        ow = gl.where(second, off_w2, off_w)
        os = gl.where(second, off_s2, off_s)
        ob = gl.where(second, off_b2, off_b)
    else:
        row = first + r
        ow, os, ob = off_w + r * 0, off_s + r * 0, off_b + r * 0
    wrow = gl.expand_dims(gl.expand_dims((base + ow + row * (K // 2)).to(gl.pointer_type(gl.int32)), 1), 2)
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
    words = wrow + gl.expand_dims(gl.expand_dims(j, 0), 2) + gl.expand_dims(gl.expand_dims(t, 0), 1) * 0
    groups = row * (K // BK)
    s = (base + os).to(gl.pointer_type(gl.bfloat16)) + groups
    b = (base + ob).to(gl.pointer_type(gl.bfloat16)) + groups
    return words, gl.expand_dims(gl.expand_dims(s, 1), 2), gl.expand_dims(gl.expand_dims(b, 1), 2)


@gluon.jit
def _step_codes(words, s_ptr, b_ptr, k):
    """K step k's code words [BN, 8, 4] and its groups' scale and bias [BN, 1, 1], loaded."""
    return gl.load(words + k * (BK // 8)), gl.load(s_ptr + k), gl.load(b_ptr + k)


@gluon.jit
def _dequantized(w, s, b, field, A: gl.constexpr, BN: gl.constexpr, WORDS: gl.constexpr):
    """Words [BN, 8, 4] (lane t of a quad keeps nibbles 2t, 2t + 1 of each) -> the MMA's operand [BN, BK] bf16:
    column 8 j + 2 t + e is nibble 2 t + e of word j."""
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
    v = w >> gl.expand_dims(gl.expand_dims(t * 8, 0), 1)
    s1 = s.to(gl.float32) * 16.0
    b1 = b.to(gl.float32) - s1
    even = ((v << 19) & field | ONE).to(gl.float32, bitcast=True) * s1 + b1
    odd = ((v << 15) & field | ONE).to(gl.float32, bitcast=True) * s1 + b1
    codes = gl.reshape(gl.join(even.to(gl.bfloat16), odd.to(gl.bfloat16)), [BN, BK])
    return gl.convert_layout(codes, A)


@gluon.jit
def _copy_rows(ring, stage, x_ptr, x_rows, valid, k, K: gl.constexpr, KSTEPS: gl.constexpr, ROWS: gl.constexpr):
    """Async copies of K step k's columns of the rows x_rows [BM] (zeros for the invalid and past K) into the
    ring's buffer `stage`, committed as one group."""
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, ROWS))
    ptrs = x_ptr + gl.expand_dims(x_rows * K, 1) + gl.expand_dims(k * BK + c, 0)
    async_copy.async_copy_global_to_shared(ring.index(stage), ptrs, gl.expand_dims(valid & (k < KSTEPS), 1))
    async_copy.commit_group()


@gluon.jit
def _issue(acc, a, ring, k, x_ptr, x_rows, valid, K: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
           ROWS: gl.constexpr):
    """Step k's MMA, queued behind step k - 1's, once every thread's copies of its rows are in; the barrier also
    finds every warp past step k - 2's MMA, whose buffer then takes the rows of step k - 2 + STAGES."""
    async_copy.wait_group(STAGES - 3)
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(a, ring.index(k % STAGES).permute((1, 0)), acc, is_async=True)
    _copy_rows(ring, (k + STAGES - 2) % STAGES, x_ptr, x_rows, valid, k + STAGES - 2, K, KSTEPS, ROWS)
    return acc


@gluon.jit
def _product(x_ptr, x_rows, valid, words, s_ptr, b_ptr, field, K: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
             STAGES: gl.constexpr, WORDS: gl.constexpr, ACC: gl.constexpr, A: gl.constexpr, ROWS: gl.constexpr,
             RING: gl.constexpr):
    """acc [BN, BM] fp32: the weight rows (codes at `words`, groups at s_ptr / b_ptr) times the rows x_rows [BM]
    of x [*, K] (valid ones; the others read as zeros). Two MMAs stay queued: step k's codes dequantize into the
    operand registers step k - 2 read, while step k - 1's MMA runs (steps alternate between operands a0 and a1);
    the rows are copied STAGES - 2 steps ahead."""
    KSTEPS: gl.constexpr = K // BK
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, x_rows.shape[0], BK], RING)
    for k in gl.static_range(STAGES - 2):
        _copy_rows(ring, k, x_ptr, x_rows, valid, k, K, KSTEPS, ROWS)
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    a1 = gl.zeros([BN, BK], gl.bfloat16, A)
    w, s, b = _step_codes(words, s_ptr, b_ptr, 0)
    for k in range(0, KSTEPS - 1, 2):
        a0 = _dequantized(w, s, b, field, A, BN, WORDS)  # step k, while step k - 1's MMA runs
        w, s, b = _step_codes(words, s_ptr, b_ptr, k + 1)
        acc = _issue(acc, a0, ring, k, x_ptr, x_rows, valid, K, KSTEPS, STAGES, ROWS)
        acc, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a1))  # step k - 1's is done
        a1 = _dequantized(w, s, b, field, A, BN, WORDS)  # step k + 1
        w, s, b = _step_codes(words, s_ptr, b_ptr, gl.minimum(k + 2, KSTEPS - 1))
        acc = _issue(acc, a1, ring, k + 1, x_ptr, x_rows, valid, K, KSTEPS, STAGES, ROWS)
        acc, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0))
    if KSTEPS % 2:  # the last step
        a0 = _dequantized(w, s, b, field, A, BN, WORDS)
        acc = _issue(acc, a0, ring, KSTEPS - 1, x_ptr, x_rows, valid, K, KSTEPS, STAGES, ROWS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM: gl.constexpr, L: gl.constexpr):
    """This program's tile in layout L: its record's base pointer, [BM] positions, their mask and entries."""
    tile = gl.program_id(0)
    base = gl.multiple_of(gl.load(tile_addr_ptr + tile).to(gl.pointer_type(gl.uint8)), 64)
    start = gl.load(tile_start_ptr + tile)
    m = gl.arange(0, BM, layout=L)
    valid = m < gl.load(tile_count_ptr + tile)
    return base, start + m, valid, gl.load(entries_ptr + start + m, mask=valid, other=0)


@gluon.jit
def _store(ptr, out, rows, cols, stride, valid, STORE: gl.constexpr):
    """out [BN', BM] to ptr[rows[m] * stride + cols[n]] for the valid m, as 16-byte runs of columns."""
    out = gl.convert_layout(out.to(gl.bfloat16), STORE)
    rows = gl.convert_layout(rows, gl.SliceLayout(0, STORE))
    valid = gl.convert_layout(valid, gl.SliceLayout(0, STORE))
    cols = gl.convert_layout(cols, gl.SliceLayout(1, STORE))
    gl.store(ptr + gl.expand_dims(rows, 0) * stride + gl.expand_dims(cols, 1), out, mask=gl.expand_dims(valid, 0))


@gluon.jit
def gate_up_kernel(x_ptr, h_ptr, entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr,
                   off_gw, off_gs, off_gb, off_uw, off_us, off_ub, field, H: gl.constexpr, I: gl.constexpr,
                   TOP_K: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
                   BN: gl.constexpr, WORDS: gl.constexpr, ACC: gl.constexpr, A: gl.constexpr, ROWS: gl.constexpr,
                   RING: gl.constexpr, STORE: gl.constexpr):
    """h[p, n] = silu(x[row] . gate[n]) * (x[row] . up[n]) for the entries p of the tile, n over this program's
    BN / 2 columns (SPARSE: a tile of no entries exits)."""
    if SPARSE:
        if gl.load(tile_count_ptr + gl.program_id(0)) == 0:
            return
    base, pos, valid, entry = _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM,
                                    gl.SliceLayout(1, ROWS))
    first = gl.program_id(1) * (BN // 2)
    words, s, b = _weight_rows(base, off_gw, off_gs, off_gb, off_uw, off_us, off_ub, first, H, BN, True, WORDS)
    acc = _product(x_ptr, entry // TOP_K, valid, words, s, b, field, H, BN, BM, STAGES, WORDS, ACC, A, ROWS, RING)
    gate, up = gl.split(gl.permute(gl.reshape(acc, [BN // 16, 2, 8, BM]), (0, 2, 3, 1)))
    h = gl.reshape(gate / (1.0 + gl.exp(-gate)) * up, [BN // 2, BM])
    cols = first + gl.arange(0, BN // 2, layout=gl.SliceLayout(1, STORE))
    _store(h_ptr, h, pos, cols, I, valid, STORE)


@gluon.jit
def down_kernel(h_ptr, y_ptr, entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, off_dw, off_ds, off_db, field,
                H: gl.constexpr, I: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
                BN: gl.constexpr, WORDS: gl.constexpr, ACC: gl.constexpr, A: gl.constexpr, ROWS: gl.constexpr,
                RING: gl.constexpr, STORE: gl.constexpr):
    """y[entry, n] = h[p] . down[n] for the entries p of the tile, n over this program's BN rows of down, written
    once per routing entry (SPARSE as gate_up_kernel's)."""
    if SPARSE:
        if gl.load(tile_count_ptr + gl.program_id(0)) == 0:
            return
    base, pos, valid, entry = _tile(entries_ptr, tile_addr_ptr, tile_start_ptr, tile_count_ptr, BM,
                                    gl.SliceLayout(1, ROWS))
    first = gl.program_id(1) * BN
    words, s, b = _weight_rows(base, off_dw, off_ds, off_db, off_dw, off_ds, off_db, first, I, BN, False, WORDS)
    acc = _product(h_ptr, pos, valid, words, s, b, field, I, BN, BM, STAGES, WORDS, ACC, A, ROWS, RING)
    cols = first + gl.arange(0, BN, layout=gl.SliceLayout(1, STORE))
    _store(y_ptr, acc, entry, cols, H, valid, STORE)
