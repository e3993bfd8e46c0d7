"""Decode's routed-expert MLP in one launch a layer. The first programs are gate/up tiles, the rest down tiles;
a down tile loads its weights, then waits for its entry's h by an arrival count. The memory pipe fills once a
layer, where two launches drain it between gate/up and down (a launch's ramp and drain are the 1-row floor)."""

import triton
import triton.language as tl

from moestream.kernels.triton.expert_gemv import _gemv_load, _span_sum, await_count, down_rows, gate_up_rows
from moestream.kernels.triton.expert_mlp import record_base
from moestream.kernels.triton.launch import dependent_start


@triton.jit
def fused_decode_kernel(x_ptr, h_ptr, y_ptr, entries_ptr, tile_addr_ptr, records_ptr, bits_ptr, counts_ptr, n,
                        off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us, off_ub, off_dw, off_dh, off_ds,
                        off_db, field_mask, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BN_UP: tl.constexpr, BK_UP: tl.constexpr,
                        SPAN_UP: tl.constexpr, AHEAD_UP: tl.constexpr, TAIL1_UP: tl.constexpr,
                        TAIL2_UP: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
                        SPAN_DOWN: tl.constexpr, AHEAD_DOWN: tl.constexpr, TAIL1_DOWN: tl.constexpr,
                        TAIL2_DOWN: tl.constexpr, PDL: tl.constexpr, INDIRECT: tl.constexpr, SELECT: tl.constexpr):
    """y[entries[i]] = (silu(x[e // TOP_K] @ gate.T) * (... @ up.T)) @ down.T for the n routing entries, as
    expert_gemv's two kernels compute it (the same bits). Programs 0..n * I / BN_UP are entry-major gate/up tiles
    and the rest down tiles, so every tile a down tile waits for was dispatched before it. counts_ptr: two zeroed
    int32 an entry (h tiles stored, down tiles that read them); the entry's last reader zeroes them again."""
    dependent_start(PDL)
    UP: tl.constexpr = I // BN_UP
    DOWN: tl.constexpr = H // BN_DOWN
    pid = tl.program_id(0)
    up_tile = pid < n * UP
    if up_tile:
        i, block = pid // UP, pid % UP
    else:
        i, block = (pid - n * UP) // DOWN, (pid - n * UP) % DOWN
    e = tl.load(entries_ptr + i)
    record = tl.load(records_ptr + i) if INDIRECT else i
    if SELECT:  # mixed precision: both kinds of tile skip the same entries
        if tl.load(bits_ptr + record) != BITS:
            return
    base = record_base(tile_addr_ptr, record)
    arrived, read = counts_ptr + 2 * i, counts_ptr + 2 * i + 1
    if up_tile:
        n_up = block * BN_UP + tl.arange(0, BN_UP)
        h = gate_up_rows(x_ptr + (e // TOP_K) * H, base, n_up, off_gw, off_gh, off_gs, off_gb, off_uw, off_uh, off_us,
                         off_ub, field_mask, H, BITS, GROUP, BN_UP, BK_UP, SPAN_UP, AHEAD_UP, TAIL1_UP, TAIL2_UP)
        tl.store(h_ptr + i * I + n_up, h.to(h_ptr.dtype.element_ty))
        tl.debug_barrier()  # every thread's h stored before the release
        tl.atomic_add(arrived, 1, sem="release", scope="gpu")
    else:
        n_down = block * BN_DOWN + tl.arange(0, BN_DOWN)
        y = down_rows(h_ptr + i * I, base, n_down, off_dw, off_dh, off_ds, off_db, field_mask, arrived, UP, I, BITS,
                      GROUP, BN_DOWN, BK_DOWN, SPAN_DOWN, AHEAD_DOWN, TAIL1_DOWN, TAIL2_DOWN, 2)
        tl.store(y_ptr + e * H + n_down, y.to(y_ptr.dtype.element_ty))
        if tl.atomic_add(read, 1, sem="relaxed", scope="gpu") == DOWN - 1:  # no tile of this launch counts again
            tl.store(arrived, 0)
            tl.store(read, 0)


@triton.jit
def _tile(t, last, PER: tl.constexpr, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT: tl.constexpr):
    """(entry index i, routing entry, record base) of tile t (clamped to `last`: its loads stay in bounds)."""
    i = tl.minimum(t, last) // PER
    record = tl.load(records_ptr + i) if INDIRECT else i
    return i, tl.load(entries_ptr + i), record_base(tile_addr_ptr, record)


@triton.jit
def _rows_load(base, off_w, off_h, n, gone, K: tl.constexpr, BITS: tl.constexpr, P1: tl.constexpr,
               P2: tl.constexpr, P3: tl.constexpr):
    """All K columns of rows n, in parts of P1, P2, P3 columns (0: none); `gone` (0 or 1) masks them all (a tile
    past the last reads nothing)."""
    skip = gone * (4 * K)  # columns past K are masked; a multiple of 4 K keeps the loads' alignment known
    w1, h1 = _gemv_load(base, off_w, off_h, n, skip, K, BITS, P1, K)
    w2, h2, w3, h3 = w1, h1, w1, h1
    if P2 > 0:
        w2, h2 = _gemv_load(base, off_w, off_h, n, P1 + skip, K, BITS, P2, K)
    if P3 > 0:
        w3, h3 = _gemv_load(base, off_w, off_h, n, P1 + P2 + skip, K, BITS, P3, K)
    return w1, h1, w2, h2, w3, h3


@triton.jit
def _rows_dot(parts, base, off_s, off_b, n, vec_ptr, field_mask, K: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BN: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr):
    """[BN]: rows n . vec over all K from `_rows_load`'s parts."""
    w1, h1, w2, h2, w3, h3 = parts
    y = _span_sum(w1, h1, base, off_s, off_b, n, vec_ptr, 0, field_mask, K, BITS, GROUP, BN, P1)
    if P2 > 0:
        y += _span_sum(w2, h2, base, off_s, off_b, n, vec_ptr, P1, field_mask, K, BITS, GROUP, BN, P2)
    if P3 > 0:
        y += _span_sum(w3, h3, base, off_s, off_b, n, vec_ptr, P1 + P2, field_mask, K, BITS, GROUP, BN, P3)
    return y


@triton.jit
def persistent_decode_kernel(x_ptr, h_ptr, y_ptr, entries_ptr, tile_addr_ptr, records_ptr, counts_ptr, n, off_gw,
                             off_gh, off_gs, off_gb, off_uw, off_uh, off_us, off_ub, off_dw, off_dh, off_ds, off_db,
                             field_mask, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr,
                             GROUP: tl.constexpr, BN_UP: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
                             U3: tl.constexpr, BN_DOWN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                             D3: tl.constexpr, PDL: tl.constexpr, INDIRECT: tl.constexpr):
    """As fused_decode_kernel, by as many programs as fit on the GPU at once, each taking tiles pid, pid + S, ...:
    its gate/up tiles, then its down tiles, each tile's words (whole rows, in parts U1..U3 of H and D1..D3 of I)
    loading while the tile before computes. A program at the tail of a one-launch layer otherwise computes with
    nothing in flight. Every program is resident, so a down tile's wait for gate/up tiles always ends."""
    dependent_start(PDL)
    UP: tl.constexpr = I // BN_UP
    DOWN: tl.constexpr = H // BN_DOWN
    S, pid = tl.num_programs(0), tl.program_id(0)
    last_down = n * DOWN - 1  # the first down tile's words load first, to be in when the gate/up tiles are done
    di, de, dbase = _tile(pid, last_down, DOWN, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
    drows = pid % DOWN * BN_DOWN + tl.arange(0, BN_DOWN)
    d = _rows_load(dbase, off_dw, off_dh, drows, (pid > last_down).to(tl.int32), I, BITS, D1, D2, D3)
    last = n * UP - 1
    i, e, base = _tile(pid, last, UP, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
    rows = pid % UP * BN_UP + tl.arange(0, BN_UP)
    g = _rows_load(base, off_gw, off_gh, rows, (pid > last).to(tl.int32), H, BITS, U1, U2, U3)
    u = _rows_load(base, off_uw, off_uh, rows, (pid > last).to(tl.int32), H, BITS, U1, U2, U3)
    i2, e2, base2 = _tile(pid + S, last, UP, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
    for t in range(pid, n * UP, S):
        rows2 = (t + S) % UP * BN_UP + tl.arange(0, BN_UP)
        g2 = _rows_load(base2, off_gw, off_gh, rows2, (t + S > last).to(tl.int32), H, BITS, U1, U2, U3)
        u2 = _rows_load(base2, off_uw, off_uh, rows2, (t + S > last).to(tl.int32), H, BITS, U1, U2, U3)
        i3, e3, base3 = _tile(t + 2 * S, last, UP, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
        xrow = x_ptr + (e // TOP_K) * H
        gate = _rows_dot(g, base, off_gs, off_gb, rows, xrow, field_mask, H, BITS, GROUP, BN_UP, U1, U2, U3)
        up = _rows_dot(u, base, off_us, off_ub, rows, xrow, field_mask, H, BITS, GROUP, BN_UP, U1, U2, U3)
        tl.store(h_ptr + i * I + rows, (gate / (1.0 + tl.exp(-gate)) * up).to(h_ptr.dtype.element_ty))
        tl.debug_barrier()  # every thread's h stored before the release
        tl.atomic_add(counts_ptr + 2 * i, 1, sem="release", scope="gpu")
        g, u, rows, i, e, base, i2, e2, base2 = g2, u2, rows2, i2, e2, base2, i3, e3, base3
    i, e, base, rows = di, de, dbase, drows
    i2, e2, base2 = _tile(pid + S, last_down, DOWN, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
    for t in range(pid, n * DOWN, S):
        rows2 = (t + S) % DOWN * BN_DOWN + tl.arange(0, BN_DOWN)
        d2 = _rows_load(base2, off_dw, off_dh, rows2, (t + S > last_down).to(tl.int32), I, BITS, D1, D2, D3)
        i3, e3, base3 = _tile(t + 2 * S, last_down, DOWN, entries_ptr, tile_addr_ptr, records_ptr, INDIRECT)
        await_count(counts_ptr + 2 * i, UP)
        y = _rows_dot(d, base, off_ds, off_db, rows, h_ptr + i * I, field_mask, I, BITS, GROUP, BN_DOWN, D1, D2, D3)
        tl.store(y_ptr + e * H + rows, y.to(y_ptr.dtype.element_ty))
        if tl.atomic_add(counts_ptr + 2 * i + 1, 1, sem="relaxed", scope="gpu") == DOWN - 1:
            tl.store(counts_ptr + 2 * i, 0)
            tl.store(counts_ptr + 2 * i + 1, 0)
        d, rows, i, e, base, i2, e2, base2 = d2, rows2, i2, e2, base2, i3, e3, base3
