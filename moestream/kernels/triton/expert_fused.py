"""Decode's routed-expert MLP in one launch a layer (opt-in, TileConfig.fused). The first programs are gate/up
tiles, the rest down tiles; a down tile loads its weights, then waits for its entry's h by an arrival count. On the
H200 it is no faster than the two launches (1 row 13.2-13.9 us against 13.5, from L2 as well; 4 rows slower): the
GEMVs' arithmetic, not the launch between them, is what does not overlap the loads (NOTES, session 20)."""

import triton
import triton.language as tl

from moestream.kernels.triton.expert_gemv import down_rows, gate_up_rows
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
