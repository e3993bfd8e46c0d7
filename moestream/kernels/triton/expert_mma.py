"""Q4 decode on tensor cores (Gluon): each warp turns its own code words into the MMA's weight fragments, two
codes a LOP3, with no shared-memory round trip; the activations are the MMA's narrow operand (column 0 of 8).

A word's nibbles c and c + 4 become one fp16 pair by a mask and an OR with 0x6400 (1024 + q, or 1024 + 16 q for
the odd nibbles, which lie in bits 4-7): a shift of 8 serves nibbles 2, 3, 6 and 7, so eight codes cost five ops.
The dot product runs over K in an order of our choosing, the same for weights and activations: `prepare_kernel`
writes the activations in that order ("fragment order": per group of 64, lane t's 16 values in its registers'
order), the odd nibbles' activations divided by 16, together with each group's sum and -1024 x its fragment sum.
The MMA's accumulator starts at the latter, so that it holds sum(q x) of the group; scale and bias then apply
once per group in fp32. The gate/up kernel writes h in the same order for the down kernel. x and h pass through
fp16: exact for bf16 values in fp16's normal range, infinite past 65504 (one reason this path is opt-in).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moestream.kernels.triton.launch import dependent_start

GROUP = tl.constexpr(64)  # codes a scale; one group is four MMA k-steps
WORDS_AHEAD = tl.constexpr(32)  # groups of words in flight: 128 registers a thread


@triton.jit
def _fragment_place(k):
    """Place in fragment order of column k of a group: lane t = k // 16 and register h + 2 c0 + 4 c1 + 8 j0, where
    column k = 16 t + 8 j0 + 4 h + 2 c1 + c0 is code c0 + 2 c1 + 4 h of the lane's word j0."""
    r = ((k >> 2) & 1) + 2 * (k & 1) + 4 * ((k >> 1) & 1) + 8 * ((k >> 3) & 1)
    return (k >> 4) * 16 + r


@triton.jit
def prepare_kernel(x_ptr, xf_ptr, xs_ptr, K: tl.constexpr, PDL: tl.constexpr):
    """Program (r, g): group g of row r of x [T, K] (bf16) -> xf [T, K] fp16 in fragment order (odd nibbles'
    columns / 16), and xs [T, K // 64, 2] fp32: (the group's sum as the MMA sees it, -1024 x its fragment's sum).
    PDL: waits for the kernel before, then lets the gate/up kernel start loading its words."""
    dependent_start(PDL)
    row, g = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * K + g * GROUP + k).to(tl.float32)
    odd = (k & 1) == 1
    f = tl.where(odd, x * 0.0625, x).to(tl.float16)
    tl.store(xf_ptr + row * K + g * GROUP + _fragment_place(k), f)
    f = f.to(tl.float32)
    at = xs_ptr + (row * (K // GROUP) + g) * 2
    tl.store(at, tl.sum(tl.where(odd, f * 16.0, f), axis=0))
    tl.store(at + 1, -1024.0 * tl.sum(f, axis=0))


@gluon.jit
def _half(p, HIGH: gl.constexpr):
    if HIGH:
        v = p >> 16
    else:
        v = p & 0xFFFF
    return v.to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _pair(w, field):
    """One fp16 pair a LOP3: the nibbles under `field` (a run-time mask, so ptxas fuses AND and OR) + 1024."""
    p = (w & field) | 0x64006400
    return gl.join(_half(p, False), _half(p, True))


@gluon.jit
def _weights(w, field, a_layout: gl.constexpr, R: gl.constexpr):
    """Words [R, 8] of one group (lane t holds words 2t, 2t+1 of rows r, r + 8) -> the MMA's A operand [R, 64]:
    position p = 32 j0 + 16 c1 + 8 c0 + 2 t + h holds code c0 + 2 c1 + 4 h of word 2 t + j0."""
    w = gl.reshape(w, [R, 4, 2])
    w8 = w >> 8
    low, high = field, field << 4
    e = gl.join(gl.join(_pair(w, low), _pair(w, high)), gl.join(_pair(w8, low), _pair(w8, high)))
    return gl.convert_layout(gl.reshape(gl.permute(e, (0, 2, 5, 4, 1, 3)), [R, GROUP]), a_layout,
                             assert_trivial=True)


@gluon.jit
def _fragment(x, b_layout: gl.constexpr):
    """One group of fragment-order activations [8, 4, 16] (column, lane, register; the columns equal) -> the MMA's
    B operand [64, 8]."""
    x = gl.reshape(x, [8, 4, 2, 2, 2, 2])  # n, t, j0, c1, c0, h
    x = gl.reshape(gl.permute(x, (2, 3, 4, 1, 5, 0)), [GROUP, 8])
    return gl.convert_layout(x, b_layout, assert_trivial=True)


def layouts(warps: int, parts: int = 1) -> dict:
    """The kernels' layouts for `warps` warps of 16 weight rows each: code words [R, 8] (lane t holds words 2t,
    2t+1 of rows r and r + 8, as the A fragment wants them), the MMA's, its operands', the fragment-order
    activations' [8, 4, 16] (column n, lane t, register; every warp holds all of them), and for staging in
    shared memory: scales [R, groups], sums [groups, parts, 2], one group's sum in every thread, and one
    group's fragment-order activations flat (lane t's 16 in its registers)."""
    rows = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    none = [[0] for _ in rows]
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    return dict(
        WORDS=gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                         lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                         warp_bases=rows, block_bases=[], shape=[16 * warps, 8]),
        MMA=mma, A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        FRAG=gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
                                        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                        warp_bases=[[0, 0, 0] for _ in rows], block_bases=[], shape=[8, 4, 16]),
        STAGE=gl.BlockedLayout([1, 8], [8, 4], [warps, 1], [1, 0]),
        SUMS=gl.BlockedLayout([1, parts, 2], [32, 1, 1], [warps, 1, 1], [2, 1, 0]),
        ONE=gl.DistributedLinearLayout(reg_bases=[], lane_bases=[[0]] * 5, warp_bases=none, block_bases=[],
                                       shape=[1]),
        LANES=gl.DistributedLinearLayout(reg_bases=[[1], [2], [4], [8]], lane_bases=[[16], [32], [0], [0], [0]],
                                         warp_bases=none, block_bases=[], shape=[64]))


@gluon.jit
def _record(entries_ptr, addr_ptr, records_ptr, INDIRECT: gl.constexpr):
    """(routing entry of this program, its record's byte pointer)."""
    i = gl.program_id(0)
    record = gl.load(records_ptr + i) if INDIRECT else i
    return gl.load(entries_ptr + i), gl.multiple_of(gl.load(addr_ptr + record).to(gl.pointer_type(gl.uint8)), 64)


@gluon.jit
def _matrix_rows(base, off_w, off_s, off_b, first_row, K: gl.constexpr, R: gl.constexpr, WORDS: gl.constexpr,
                 STAGE: gl.constexpr, SPLIT: gl.constexpr, off_w2, off_s2, off_b2):
    """Word pointers [R, 8] of group 0 and scale / bias pointers [R] (STAGE's rows) of rows first_row.. of a
    matrix of K columns; with SPLIT, rows R // 2.. are the same rows of a second matrix (up beside gate)."""
    rw = gl.arange(0, R, layout=gl.SliceLayout(1, WORDS))
    rs = gl.arange(0, R, layout=gl.SliceLayout(1, STAGE))
    if SPLIT:
        ow = gl.where(rw >= R // 2, off_w2, off_w) + (first_row + rw % (R // 2)) * (K // 2)
        row = first_row + rs % (R // 2)
        os = gl.where(rs >= R // 2, off_s2, off_s) + row * (K // GROUP * 2)
        ob = gl.where(rs >= R // 2, off_b2, off_b) + row * (K // GROUP * 2)
    else:
        ow = off_w + (first_row + rw) * (K // 2)
        os = off_s + (first_row + rs) * (K // GROUP * 2)
        ob = off_b + (first_row + rs) * (K // GROUP * 2)
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
    words = (base + ow).to(gl.pointer_type(gl.int32))[:, None] + j[None, :]
    return words, (base + os).to(gl.pointer_type(gl.bfloat16)), (base + ob).to(gl.pointer_type(gl.bfloat16))


@gluon.jit
def _staged(ptr_rows, G: gl.constexpr, GP: gl.constexpr, STAGE: gl.constexpr, SHARED: gl.constexpr):
    """Columns 0..G of rows `ptr_rows` [R] (STAGE's rows) in shared memory, column after column (flat: a slice
    of a 2-D view drops no rank): a group's is then read in ~30 cycles where a global load per group put an L2
    round trip in every step."""
    g = gl.arange(0, GP, layout=gl.SliceLayout(0, STAGE))
    t = gl.load(ptr_rows[:, None] + g[None, :], mask=(g < G)[None, :], other=0.0)
    return gl.allocate_shared_memory(t.dtype, [GP * t.shape[0]], SHARED, gl.reshape(gl.permute(t, (1, 0)),
                                                                                      [GP * t.shape[0]]))


@gluon.jit
def _dot(words, s_ptr, b_ptr, xf_ptr, xs_ptr, field, WAIT: gl.constexpr, K: gl.constexpr, PARTS: gl.constexpr,
         R: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr,
         STAGE: gl.constexpr, SUMS: gl.constexpr, ONE: gl.constexpr, LANES: gl.constexpr):
    """[R] rows . one row of fragment-order activations (xf_ptr at its first group; xs_ptr at its groups' sums,
    PARTS pairs a group, added in order). The first WORDS_AHEAD groups' words load first (all of K 2048) and the
    rows' scales and biases go to shared memory, before the wait for the kernel that wrote the activations
    (WAIT); the activations and sums go to shared memory too. A group computes as its words arrive, and loads the
    words WORDS_AHEAD groups on."""
    G: gl.constexpr = K // GROUP
    GP: gl.constexpr = triton.next_power_of_2(G)
    AHEAD: gl.constexpr = G if G < WORDS_AHEAD else WORDS_AHEAD
    SHARED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    w = ()
    for g in gl.static_range(AHEAD):
        w = w + (gl.load(words + g * 8),)
    scales = _staged(s_ptr, G, GP, STAGE, SHARED)
    biases = _staged(b_ptr, G, GP, STAGE, SHARED)
    if WAIT:
        gdc_wait()
    gs = gl.arange(0, GP, layout=gl.SliceLayout(1, STAGE))
    ks = gl.arange(0, GROUP, layout=gl.SliceLayout(0, STAGE))
    x = gl.load(xf_ptr + gs[:, None] * GROUP + ks[None, :], mask=(gs < G)[:, None], other=0.0)
    x = gl.allocate_shared_memory(gl.float16, [GP * GROUP], SHARED, gl.reshape(x, [GP * GROUP]))
    gp = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, SUMS)))
    pp = gl.arange(0, PARTS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SUMS)))
    two = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SUMS)))
    sums = gl.load(xs_ptr + (gp[:, None, None] * PARTS + pp[None, :, None]) * 2 + two[None, None, :],
                   mask=(gp < G)[:, None, None], other=0.0)
    sx, start = gl.split(gl.sum(sums, axis=1))
    sx = gl.allocate_shared_memory(gl.float32, [GP], SHARED, sx)
    start = gl.allocate_shared_memory(gl.float32, [GP], SHARED, start)
    gl.thread_barrier()
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([R, 8], gl.float32, MMA)
    for g in gl.static_range(G):
        if g + AHEAD < G:  # a group's words stay WORDS_AHEAD groups ahead
            w = w + (gl.load(words + (g + AHEAD) * 8),)
        sx_g = gl.sum(sx.slice(g, 1).load(ONE), axis=0)
        start_g = gl.sum(start.slice(g, 1).load(ONE), axis=0)
        xg = gl.convert_layout(gl.reshape(x.slice(g * GROUP, GROUP).load(LANES), [4, 16]), gl.SliceLayout(0, FRAG),
                               assert_trivial=True)
        xg = gl.broadcast(gl.expand_dims(xg, 0), gl.full([8, 4, 16], 0, gl.float16, FRAG))[0]
        d = mma_v2(_weights(w[g], field, A, R), _fragment(xg, B), gl.full([R, 8], start_g, gl.float32, MMA))
        acc += scales.slice(g * R, R).load(rows).to(gl.float32)[:, None] * d  # 2 FFMAs, not FMUL, FFMA, FADD
        acc += biases.slice(g * R, R).load(rows).to(gl.float32)[:, None] * sx_g
    return gl.sum(gl.where((n == 0)[None, :], acc, 0.0), axis=1)  # the columns are equal: one suffices


@gluon.jit
def gate_up_mma_kernel(xf_ptr, xs_ptr, hf_ptr, hs_ptr, entries_ptr, addr_ptr, records_ptr, off_gw, off_gs, off_gb,
                       off_uw, off_us, off_ub, field, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr,
                       INDIRECT: gl.constexpr, PDL: gl.constexpr, WORDS: gl.constexpr, MMA: gl.constexpr,
                       A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr, STAGE: gl.constexpr,
                       SUMS: gl.constexpr, ONE: gl.constexpr, LANES: gl.constexpr, HALVES: gl.constexpr):
    """Program (i, blk): h[i] over rows blk * RB.. of I (RB = 8 x num_warps) = silu(gate rows . x) * (up rows . x),
    for routing entry entries[i] on the record at addr[i] (addr[records[i]] when INDIRECT). h goes in fragment
    order for the down kernel, with its sums a block (GROUP // RB blocks a group). The first half of the warps
    takes the gate rows, the second the up rows; x in fragment order (prepare_kernel). PDL: launched as a
    dependent of prepare_kernel (the words load before the wait)."""
    R: gl.constexpr = 16 * gl.num_warps()
    RB: gl.constexpr = R // 2
    if PDL:
        gdc_launch_dependents()
    e, base = _record(entries_ptr, addr_ptr, records_ptr, INDIRECT)
    blk = gl.program_id(1)
    words, s_ptr, b_ptr = _matrix_rows(base, off_gw, off_gs, off_gb, blk * RB, H, R, WORDS, STAGE, True, off_uw,
                                       off_us, off_ub)
    row = e // TOP_K
    y = _dot(words, s_ptr, b_ptr, xf_ptr + row * H, xs_ptr + row * (H // GROUP) * 2, field, PDL, H, 1, R, MMA, A,
             B, FRAG, STAGE, SUMS, ONE, LANES)
    gate, up = gl.split(gl.convert_layout(gl.permute(gl.reshape(y, [2, RB]), (1, 0)), HALVES))
    h = gate / (1.0 + gl.exp(-gate)) * up
    k = blk * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, HALVES))  # column of the down matrix
    odd = (k & 1) == 1
    f = gl.where(odd, h * 0.0625, h).to(gl.float16)
    i = gl.program_id(0)
    gl.store(hf_ptr + i * I + k // GROUP * GROUP + _fragment_place(k % GROUP), f)
    f = f.to(gl.float32)
    at = hs_ptr + (i * (I // RB) + blk) * 2
    gl.store(at, gl.sum(gl.where(odd, f * 16.0, f), axis=0))
    gl.store(at + 1, -1024.0 * gl.sum(f, axis=0))


@gluon.jit
def down_mma_kernel(hf_ptr, hs_ptr, y_ptr, entries_ptr, addr_ptr, records_ptr, off_dw, off_ds, off_db, field,
                    H: gl.constexpr, I: gl.constexpr, PARTS: gl.constexpr, INDIRECT: gl.constexpr, PDL: gl.constexpr,
                    WORDS: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr,
                    STAGE: gl.constexpr, SUMS: gl.constexpr, ONE: gl.constexpr, LANES: gl.constexpr):
    """Program (i, blk): y[entries[i]] rows blk * R.. = down rows . h[i] (h in fragment order, from the gate/up
    kernel, PARTS blocks' sums a group). PDL: the words load while the gate/up kernel runs."""
    R: gl.constexpr = 16 * gl.num_warps()
    e, base = _record(entries_ptr, addr_ptr, records_ptr, INDIRECT)
    blk = gl.program_id(1)
    words, s_ptr, b_ptr = _matrix_rows(base, off_dw, off_ds, off_db, blk * R, I, R, WORDS, STAGE, False, off_dw,
                                       off_ds, off_db)
    i = gl.program_id(0)
    y = _dot(words, s_ptr, b_ptr, hf_ptr + i * I, hs_ptr + i * (I // GROUP) * PARTS * 2, field, PDL, I, PARTS, R,
             MMA, A, B, FRAG, STAGE, SUMS, ONE, LANES)
    r = blk * R + gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
    gl.store(y_ptr + e * H + r, y.to(gl.bfloat16))
