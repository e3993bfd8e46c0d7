"""Q4 decode on tensor cores (Gluon): each program copies its weight rows into shared memory with async copies
(cp.async) in whole 128-byte lines, several stages in flight, and computes each stage as it lands; each warp turns
its code words into the MMA's weight fragments there, two codes a LOP3; the activations are the MMA's narrow
operand (column 0 of 8).

A word's nibbles c and c + 4 become one bf16 pair by a shift of 4c, a mask and an OR with 0x4300 (128 + q, exact),
so eight codes cost seven ops. The dot product runs over K in an order of our choosing, the same for weights and
activations ("fragment order": per group of 64, lane t's 16 values in its registers' order). The MMA's accumulator
starts at -128 x the group's sum, so that it holds sum(q x) of the group; scale and bias then apply once per group
in fp32. The gate/up kernel puts x in fragment order itself and writes h in it for the down kernel, with each
block's sum. x and h stay bf16, as the reference rounds them.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

GROUP = tl.constexpr(64)  # codes a scale; one group is four MMA k-steps
CHUNK = tl.constexpr(4)  # groups a copy stage: 128 bytes of each row, so a warp's copies read whole lines
MAGIC = tl.constexpr(128.0)  # what 0x4300 puts under each code
BATCH = tl.constexpr(4)  # groups whose operands and MMAs go side by side (H200: 1 row 13.8 -> 12.9 us a step)


@triton.jit
def _fragment_place(k):
    """Place in fragment order of column k of a group: lane t = k // 16 and register h + 2 c0 + 4 c1 + 8 j0, where
    column k = 16 t + 8 j0 + 4 h + 2 c1 + c0 is code c0 + 2 c1 + 4 h of the lane's word j0."""
    r = ((k >> 2) & 1) + 2 * (k & 1) + 4 * ((k >> 1) & 1) + 8 * ((k >> 3) & 1)
    return (k >> 4) * 16 + r


@triton.jit
def _fragment_column(p):
    """The column of a group at fragment place p: the inverse of `_fragment_place`."""
    return (p >> 4) * 16 + 8 * ((p >> 3) & 1) + 4 * (p & 1) + 2 * ((p >> 2) & 1) + ((p >> 1) & 1)


@gluon.jit
def _half(p, HIGH: gl.constexpr):
    if HIGH:
        v = p >> 16
    else:
        v = p & 0xFFFF
    return v.to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _pair(w, field):
    """One bf16 pair a LOP3: the nibbles under `field` (a run-time mask, so ptxas fuses AND and OR) + 128."""
    p = (w & field) | 0x43004300
    return gl.join(_half(p, False), _half(p, True))


@gluon.jit
def _weights(w, field, a_layout: gl.constexpr, R: gl.constexpr):
    """Words [R, 8] of one group (lane t holds words 2t, 2t+1 of rows r, r + 8) -> the MMA's A operand [R, 64]:
    position p = 32 j0 + 16 c1 + 8 c0 + 2 t + h holds code c0 + 2 c1 + 4 h of word 2 t + j0."""
    w = gl.reshape(w, [R, 4, 2])
    e = gl.join(gl.join(_pair(w, field), _pair(w >> 4, field)), gl.join(_pair(w >> 8, field), _pair(w >> 12, field)))
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
    2t+1 of rows r and r + 8, as the A fragment wants them), a copy stage's words [CHUNK, R, 8] (16 bytes a lane,
    8 lanes a row's 128 bytes), the MMA's, its operands', the fragment-order activations' [8, 4, 16] (column n,
    lane t, register; every warp holds all of them), and for staging in shared memory: scales [R, groups], sums
    [groups, parts, 2], one group's sum in every thread, and one group's fragment-order activations flat (lane
    t's 16 in its registers)."""
    rows = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    none = [[0] for _ in rows]
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    return dict(
        WORDS=gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                         lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                         warp_bases=rows, block_bases=[], shape=[16 * warps, 8]),
        COPY=gl.BlockedLayout([1, 1, 4], [CHUNK.value, 16 // CHUNK.value, 2], [1, warps, 1], [2, 0, 1]),
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
def record_of(entries_ptr, addr_ptr, records_ptr, INDIRECT: gl.constexpr):
    """(routing entry of this program, its record's byte pointer)."""
    i = gl.program_id(0)
    record = gl.load(records_ptr + i) if INDIRECT else i
    return gl.load(entries_ptr + i), gl.multiple_of(gl.load(addr_ptr + record).to(gl.pointer_type(gl.uint8)), 64)


@gluon.jit
def _row_offsets(off, off2, first_row, row_bytes: gl.constexpr, R: gl.constexpr, layout: gl.constexpr,
                 SPLIT: gl.constexpr):
    """Byte offsets [R] (in `layout`) of rows first_row.. of a matrix at `off` with rows of `row_bytes`; with
    SPLIT, rows R // 2.. are the same rows of a second matrix at `off2` (up beside gate)."""
    r = gl.arange(0, R, layout=layout)
    if SPLIT:
        return gl.where(r >= R // 2, off2, off) + (first_row + r % (R // 2)) * row_bytes
    return off + (first_row + r) * row_bytes


@gluon.jit
def matrix_rows(base, off_w, off_s, off_b, first_row, K: gl.constexpr, R: gl.constexpr, COPY: gl.constexpr,
                 STAGE: gl.constexpr, SPLIT: gl.constexpr, off_w2, off_s2, off_b2):
    """Word pointers [CHUNK, R, 8] of copy stage 0 (COPY) and scale / bias pointers [R] (STAGE's rows) of rows
    first_row.. of a matrix of K columns; with SPLIT, rows R // 2.. are the same rows of a second matrix."""
    rows: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, COPY))
    ow = _row_offsets(off_w, off_w2, first_row, K // 2, R, rows, SPLIT)
    os = _row_offsets(off_s, off_s2, first_row, K // GROUP * 2, R, gl.SliceLayout(1, STAGE), SPLIT)
    ob = _row_offsets(off_b, off_b2, first_row, K // GROUP * 2, R, gl.SliceLayout(1, STAGE), SPLIT)
    g = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    words = (base + ow).to(gl.pointer_type(gl.int32))[None, :, None] + (g[:, None, None] * 8 + j[None, None, :])
    return words, (base + os).to(gl.pointer_type(gl.bfloat16)), (base + ob).to(gl.pointer_type(gl.bfloat16))


@gluon.jit
def copy_stage(dst, words, c: gl.constexpr, G: gl.constexpr, COPY: gl.constexpr):
    """Groups c * CHUNK.. of the rows into `dst` [CHUNK, R, 8] (async copies, one commit group); past G none."""
    src = words + c * CHUNK * 8
    if (c + 1) * CHUNK > G:
        g = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
        async_copy.async_copy_global_to_shared(dst, src, mask=(g < G)[:, None, None])
    else:
        async_copy.async_copy_global_to_shared(dst, src)
    async_copy.commit_group()


@gluon.jit
def word_buffers(S: gl.constexpr, R: gl.constexpr):
    """S buffers of CHUNK groups of R rows' words [CHUNK, R, 8] (the copies' view), and the same memory by group
    [S * CHUNK * R, 8]: each group's words 32 bytes a row, so that a warp's fragment loads read 256 contiguous
    bytes, and its copies of 4 rows' lines fill all 32 banks a group."""
    SP: gl.constexpr = triton.next_power_of_2(S)  # shapes in shared memory are powers of two
    buffers = gl.allocate_shared_memory(gl.int32, [SP * CHUNK, R, 8], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    return buffers, buffers._reinterpret(gl.int32, [SP * CHUNK * R, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def group_words(by_group, g: gl.constexpr, S: gl.constexpr, R: gl.constexpr, WORDS: gl.constexpr):
    """Group g's words [R, 8] (WORDS) from its stage's buffer."""
    return by_group.slice((g // CHUNK % S * CHUNK + g % CHUNK) * R, R).load(WORDS)


@gluon.jit
def stage_in(buffers, words, s: gl.constexpr, S: gl.constexpr, NS: gl.constexpr, G: gl.constexpr,
              COPY: gl.constexpr):
    """Wait until copy stage s is in for every warp (its commit group and those before it), then give the buffer
    of stage s - 1, which every warp is past, the stage S - 1 on."""
    LAST: gl.constexpr = S - 1 + (s - 1 if s > 0 else 0)  # the last stage committed by now
    async_copy.wait_group((LAST if LAST < NS - 1 else NS - 1) - s)
    gl.thread_barrier()
    if s > 0 and s + S - 1 < NS:
        copy_stage(buffers.slice((s - 1) % S * CHUNK, CHUNK), words, s + S - 1, G, COPY)


@gluon.jit
def _columns(ptr_rows, G: gl.constexpr, GP: gl.constexpr, STAGE: gl.constexpr):
    """Columns 0..G of rows `ptr_rows` [R] (STAGE's rows), loaded [R, GP]."""
    g = gl.arange(0, GP, layout=gl.SliceLayout(0, STAGE))
    return gl.load(ptr_rows[:, None] + g[None, :], mask=(g < G)[None, :], other=0.0)


@gluon.jit
def _by_column(t, SHARED: gl.constexpr):
    """[R, GP] in shared memory column after column (flat: a slice of a 2-D view drops no rank): a group's is
    then read in ~30 cycles where a global load per group put an L2 round trip in every step."""
    n: gl.constexpr = t.shape[0] * t.shape[1]
    return gl.allocate_shared_memory(t.dtype, [n], SHARED, gl.reshape(gl.permute(t, (1, 0)), [n]))


@gluon.jit
def _activations(x_ptr, xs_ptr, PREP: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, PARTS: gl.constexpr,
                 STAGE: gl.constexpr, SUMS: gl.constexpr):
    """Fragment-order activations [GP, 64] and each group's (sum, MMA start) [GP], loaded. PREP: from the row
    x_ptr in column order, gathered into fragment order here; else already in it, with PARTS pairs of
    (sum, start) a group at xs_ptr, added in order."""
    gs = gl.arange(0, GP, layout=gl.SliceLayout(1, STAGE))
    ks = gl.arange(0, GROUP, layout=gl.SliceLayout(0, STAGE))
    if PREP:
        x = gl.load(x_ptr + gs[:, None] * GROUP + _fragment_column(ks)[None, :], mask=(gs < G)[:, None], other=0.0)
        sx = gl.sum(x.to(gl.float32), axis=1)
        start = sx * -MAGIC
    else:
        x = gl.load(x_ptr + gs[:, None] * GROUP + ks[None, :], mask=(gs < G)[:, None], other=0.0)
        gp = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, SUMS)))
        pp = gl.arange(0, PARTS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SUMS)))
        two = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SUMS)))
        sums = gl.load(xs_ptr + (gp[:, None, None] * PARTS + pp[None, :, None]) * 2 + two[None, None, :],
                       mask=(gp < G)[:, None, None], other=0.0)
        sx, start = gl.split(gl.sum(sums, axis=1))
    return x, sx, start


@gluon.jit
def _shared(x, sx, start, SHARED: gl.constexpr):
    """`_activations`' tensors in shared memory, x flat."""
    n: gl.constexpr = x.shape[0] * x.shape[1]
    return (gl.allocate_shared_memory(x.dtype, [n], SHARED, gl.reshape(x, [n])),
            gl.allocate_shared_memory(gl.float32, [sx.shape[0]], SHARED, sx),
            gl.allocate_shared_memory(gl.float32, [sx.shape[0]], SHARED, start))


@gluon.jit
def stamp(trace_ptr, slot: gl.constexpr, TRACE: gl.constexpr):
    """TRACE (benchmarks/decode_mma.py --trace): %globaltimer (ns) into trace_ptr[slot]; slot 0 also the SM."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [gl.program_id(0)], dtype=gl.int64,
                                        is_pure=False, pack=1)
        gl.store(trace_ptr + slot, now)
        if slot == 0:
            sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [gl.program_id(0)], dtype=gl.int32,
                                           is_pure=False, pack=1)
            gl.store(trace_ptr + 7, sm.to(gl.int64))


@gluon.jit
def _dot(words, s_ptr, b_ptr, x_ptr, xs_ptr, field, PREP: gl.constexpr, WAIT: gl.constexpr, TRIGGER: gl.constexpr,
         K: gl.constexpr, PARTS: gl.constexpr, STAGES: gl.constexpr, R: gl.constexpr, WORDS: gl.constexpr,
         COPY: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr,
         STAGE: gl.constexpr, SUMS: gl.constexpr, ONE: gl.constexpr, LANES: gl.constexpr, trace_ptr,
         TRACE: gl.constexpr):
    """[R] rows . one row of activations (`_activations`). The words come in copy stages of CHUNK groups, STAGES
    in flight (0, or at least the stage count: all at once); a stage computes once it is in, and frees its buffer
    for the stage STAGES on. The rows' scales and biases, and the activations unless they wait for the kernel
    that wrote them (WAIT), load before the words: behind them they would arrive with the last stage. TRIGGER > 0:
    the next kernel (a dependent) may launch once that many stages are in."""
    G: gl.constexpr = K // GROUP
    GP: gl.constexpr = triton.next_power_of_2(G)
    NS: gl.constexpr = triton.cdiv(G, CHUNK)  # copy stages
    S: gl.constexpr = NS if STAGES == 0 or STAGES >= NS else STAGES  # buffers: the stages in flight
    gl.static_assert(S >= 2 or S == NS, "a ring of copy stages needs two buffers")
    gl.static_assert(CHUNK % BATCH == 0, "a batch of groups lies in one copy stage")
    SHARED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    buffers, by_group = word_buffers(S, R)
    stamp(trace_ptr, 1, TRACE)
    if not WAIT:
        x, sx, start = _activations(x_ptr, xs_ptr, PREP, G, GP, PARTS, STAGE, SUMS)
    scales = _columns(s_ptr, G, GP, STAGE)
    biases = _columns(b_ptr, G, GP, STAGE)
    for c in gl.static_range(S):
        copy_stage(buffers.slice(c * CHUNK, CHUNK), words, c, G, COPY)
    scales = _by_column(scales, SHARED)
    biases = _by_column(biases, SHARED)
    if WAIT:
        gdc_wait()
        x, sx, start = _activations(x_ptr, xs_ptr, PREP, G, GP, PARTS, STAGE, SUMS)
    x, sx, start = _shared(x, sx, start, SHARED)
    stamp(trace_ptr, 2, TRACE)
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([R, 8], gl.float32, MMA)
    for g0 in gl.static_range(0, G, BATCH):  # independent MMA chains side by side
        if g0 % CHUNK == 0:
            stage_in(buffers, words, g0 // CHUNK, S, NS, G, COPY)
            if TRIGGER > 0 and g0 // CHUNK + 1 == (TRIGGER if TRIGGER < NS else NS):
                gdc_launch_dependents()
            if g0 == 0:
                stamp(trace_ptr, 3, TRACE)
            if g0 // CHUNK == NS - 1:
                stamp(trace_ptr, 4, TRACE)
        d = ()
        for g in gl.static_range(g0, g0 + BATCH if g0 + BATCH < G else G):
            a = _weights(group_words(by_group, g, S, R, WORDS), field, A, R)
            start_g = gl.sum(start.slice(g, 1).load(ONE), axis=0)
            xg = gl.convert_layout(gl.reshape(x.slice(g * GROUP, GROUP).load(LANES), [4, 16]),
                                   gl.SliceLayout(0, FRAG), assert_trivial=True)
            xg = gl.broadcast(gl.expand_dims(xg, 0), gl.full([8, 4, 16], 0, gl.bfloat16, FRAG))[0]
            d = d + (mma_v2(a, _fragment(xg, B), gl.full([R, 8], start_g, gl.float32, MMA)),)
        for g in gl.static_range(g0, g0 + BATCH if g0 + BATCH < G else G):
            sx_g = gl.sum(sx.slice(g, 1).load(ONE), axis=0)
            acc += scales.slice(g * R, R).load(rows).to(gl.float32)[:, None] * d[g - g0]  # 2 FFMAs, not 3 ops
            acc += biases.slice(g * R, R).load(rows).to(gl.float32)[:, None] * sx_g
    stamp(trace_ptr, 5, TRACE)
    return gl.sum(gl.where((n == 0)[None, :], acc, 0.0), axis=1)  # the columns are equal: one suffices


@gluon.jit
def gate_up_mma_kernel(x_ptr, hf_ptr, hs_ptr, entries_ptr, addr_ptr, records_ptr, off_gw, off_gs, off_gb, off_uw,
                       off_us, off_ub, field, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr,
                       INDIRECT: gl.constexpr, PDL: gl.constexpr, WAIT: gl.constexpr, STAGES: gl.constexpr,
                       TRIGGER: gl.constexpr, TRACE: gl.constexpr, trace_ptr, WORDS: gl.constexpr,
                       COPY: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr,
                       STAGE: gl.constexpr, SUMS: gl.constexpr, ONE: gl.constexpr, LANES: gl.constexpr,
                       HALVES: gl.constexpr):
    """Program (i, blk): h[i] over rows blk * RB.. of I (RB = 8 x num_warps) = silu(gate rows . x) * (up rows . x),
    for routing entry entries[i] on the record at addr[i] (addr[records[i]] when INDIRECT). h goes in fragment
    order for the down kernel, with its sums a block (GROUP // RB blocks a group). The first half of the warps
    takes the gate rows, the second the up rows. PDL: lets the down kernel start (to copy its words meanwhile), at
    once or with TRIGGER > 0 once that many copy stages are in (its copies then compete less with these); WAIT:
    launched as a dependent; with addresses from the host (not INDIRECT) the words copy before the wait for x."""
    R: gl.constexpr = 16 * gl.num_warps()
    RB: gl.constexpr = R // 2
    trace_ptr = trace_ptr + (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * 8
    stamp(trace_ptr, 0, TRACE)
    if PDL and TRIGGER == 0:
        gdc_launch_dependents()
    if WAIT and INDIRECT:  # the expert ids come from the kernel before
        gdc_wait()
    e, base = record_of(entries_ptr, addr_ptr, records_ptr, INDIRECT)
    blk = gl.program_id(1)
    words, s_ptr, b_ptr = matrix_rows(base, off_gw, off_gs, off_gb, blk * RB, H, R, COPY, STAGE, True, off_uw,
                                       off_us, off_ub)
    y = _dot(words, s_ptr, b_ptr, x_ptr + (e // TOP_K) * H, x_ptr, field, True, WAIT and not INDIRECT,
             TRIGGER if PDL else 0, H, 1, STAGES, R, WORDS, COPY, MMA, A, B, FRAG, STAGE, SUMS, ONE, LANES, trace_ptr,
             TRACE)
    gate, up = gl.split(gl.convert_layout(gl.permute(gl.reshape(y, [2, RB]), (1, 0)), HALVES))
    h = (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16)
    k = blk * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, HALVES))  # column of the down matrix
    i = gl.program_id(0)
    gl.store(hf_ptr + i * I + k // GROUP * GROUP + _fragment_place(k % GROUP), h)
    sum_h = gl.sum(h.to(gl.float32), axis=0)
    at = hs_ptr + (i * (I // RB) + blk) * 2
    gl.store(at, sum_h)
    gl.store(at + 1, sum_h * -MAGIC)
    stamp(trace_ptr, 6, TRACE)


@gluon.jit
def down_mma_kernel(hf_ptr, hs_ptr, y_ptr, entries_ptr, addr_ptr, records_ptr, off_dw, off_ds, off_db, field,
                    H: gl.constexpr, I: gl.constexpr, PARTS: gl.constexpr, INDIRECT: gl.constexpr, PDL: gl.constexpr,
                    STAGES: gl.constexpr, TRACE: gl.constexpr, trace_ptr, WORDS: gl.constexpr,
                    COPY: gl.constexpr, MMA: gl.constexpr,
                    A: gl.constexpr, B: gl.constexpr, FRAG: gl.constexpr, STAGE: gl.constexpr, SUMS: gl.constexpr,
                    ONE: gl.constexpr, LANES: gl.constexpr):
    """Program (i, blk): y[entries[i]] rows blk * R.. = down rows . h[i] (h in fragment order, from the gate/up
    kernel, PARTS blocks' sums a group). PDL: the words copy while the gate/up kernel runs."""
    R: gl.constexpr = 16 * gl.num_warps()
    trace_ptr = trace_ptr + (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * 8
    stamp(trace_ptr, 0, TRACE)
    e, base = record_of(entries_ptr, addr_ptr, records_ptr, INDIRECT)
    blk = gl.program_id(1)
    words, s_ptr, b_ptr = matrix_rows(base, off_dw, off_ds, off_db, blk * R, I, R, COPY, STAGE, False, off_dw,
                                       off_ds, off_db)
    i = gl.program_id(0)
    y = _dot(words, s_ptr, b_ptr, hf_ptr + i * I, hs_ptr + i * (I // GROUP) * PARTS * 2, field, False, PDL, 0, I, PARTS,
             STAGES, R, WORDS, COPY, MMA, A, B, FRAG, STAGE, SUMS, ONE, LANES, trace_ptr, TRACE)
    r = blk * R + gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
    gl.store(y_ptr + e * H + r, y.to(gl.bfloat16))
    stamp(trace_ptr, 6, TRACE)
