"""A prefill step's tile tables built on the device (reference.placed_tiles): the expert kernels' tiles over a layer
whose every record sits in the GPU pool, with no routing counts sent to the host. Two launches, each of many
programs: one program's serial histogram over 32k entries took 53 us a layer."""

import triton
import triton.language as tl


@triton.jit
def expert_counts_kernel(ids_ptr, counts_ptr, real_ptr, n, chunks, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                         PADDED: tl.constexpr):
    """Program c: counts[0, c] = the histogram of ids[c * CHUNK:][:CHUNK] (int32 [BLOCK_E]); PADDED: only entries
    before real[0] there, and all of them in counts[1, c]."""
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    i = c * CHUNK + tl.arange(0, CHUNK)
    live = i < n
    expert = tl.load(ids_ptr + i, mask=live, other=0).to(tl.int32)
    if PADDED:
        tl.store(counts_ptr + (chunks + c) * BLOCK_E + e, tl.histogram(expert, BLOCK_E, mask=live))
        live &= i < tl.load(real_ptr)
    tl.store(counts_ptr + c * BLOCK_E + e, tl.histogram(expert, BLOCK_E, mask=live))


@triton.jit
def _chunk_sum(counts_ptr, chunks, BLOCK_E: tl.constexpr, SUM_ROWS: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, chunks, SUM_ROWS):
        c = c0 + tl.arange(0, SUM_ROWS)
        total += tl.sum(tl.load(counts_ptr + c[:, None] * BLOCK_E + e[None, :], mask=c[:, None] < chunks, other=0), 0)
    return total


@triton.jit
def tile_tables_kernel(counts_ptr, table_ptr, uses_ptr, full_ptr, tail_ptr, chunks, max_full, E: tl.constexpr,
                       BLOCK_E: tl.constexpr, SUM_ROWS: tl.constexpr, BM: tl.constexpr, TAIL_BM: tl.constexpr,
                       TILES: tl.constexpr, PADDED: tl.constexpr):
    """Program p writes full-height tiles p * TILES.. from the chunks' expert counts (expert_counts_kernel), whose
    stable sort puts expert e's entries at offsets[e]. full [3, max_full]: address, first position and count of each
    full-height tile, experts in id order (count 0 past the last); program 0 writes tail [3, E]: expert e's last
    tile of at most TAIL_BM entries (count 0: none), as `prefill_tiles` splits them, and adds 1 to uses[e] for each
    expert the entries use. PADDED: counts[0] holds the tiled entries' counts, counts[1] all entries'."""
    e = tl.arange(0, BLOCK_E)
    counts = _chunk_sum(counts_ptr, chunks, BLOCK_E, SUM_ROWS)
    if PADDED:
        every = _chunk_sum(counts_ptr + chunks * BLOCK_E, chunks, BLOCK_E, SUM_ROWS)
    else:
        every = counts
    offsets = tl.cumsum(every, 0) - every
    whole = counts // BM
    rest = counts - whole * BM
    tail = (rest > 0) & (rest <= TAIL_BM)
    full = whole + ((rest > 0) & (tail == 0)).to(tl.int32)
    ends = tl.cumsum(full, 0)
    firsts = ends - full
    known = e < E
    addr = tl.load(table_ptr + e, mask=known, other=0)
    if tl.program_id(0) == 0:
        tl.store(uses_ptr + e, tl.load(uses_ptr + e, mask=known, other=0) + (counts > 0).to(tl.int32), mask=known)
        tl.store(tail_ptr + e, addr, mask=known)
        tl.store(tail_ptr + E + e, (offsets + whole * BM).to(tl.int64), mask=known)
        tl.store(tail_ptr + 2 * E + e, tl.where(tail, rest, 0).to(tl.int64), mask=known)
    total = tl.sum(full, 0)
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    mine = (firsts[None, :] <= t[:, None]) & (t[:, None] < ends[None, :])  # [TILES, BLOCK_E]: its expert
    first = t - tl.sum(tl.where(mine, firsts[None, :], 0), 1)  # the tile's index within its expert
    start = tl.sum(tl.where(mine, offsets[None, :], 0), 1) + first * BM
    count = tl.minimum(tl.sum(tl.where(mine, counts[None, :], 0), 1) - first * BM, BM)
    tiled = t < total
    on = t < max_full
    tl.store(full_ptr + t, tl.sum(tl.where(mine, addr[None, :], 0), 1), mask=on)
    tl.store(full_ptr + max_full + t, tl.where(tiled, start, 0).to(tl.int64), mask=on)
    tl.store(full_ptr + 2 * max_full + t, tl.where(tiled, count, 0).to(tl.int64), mask=on)
