"""A prefill step's tile tables built on the device (reference.placed_tiles): the expert kernels' tiles over a layer
whose every record sits in the GPU pool, with no routing counts sent to the host."""

import triton
import triton.language as tl


@triton.jit
def tile_tables_kernel(ids_ptr, table_ptr, uses_ptr, full_ptr, tail_ptr, real_ptr, n, max_full, E: tl.constexpr,
                       BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr, TAIL_BM: tl.constexpr,
                       TILES: tl.constexpr, PADDED: tl.constexpr):
    """One program. ids[:n]: the expert of each flat routing entry, whose stable sort puts expert e's entries at
    offsets[e]. full [3, max_full]: address, first position and count of each full-height tile, experts in id order
    (count 0 past the last); tail [3, E]: expert e's last tile of at most TAIL_BM entries (count 0: none), as
    `prefill_tiles` splits them. uses[e] += 1 for each expert the entries use. PADDED: only the first real[0]
    entries are tiled (a padded prompt's own, which the sort keeps ahead of the others of their expert)."""
    e = tl.arange(0, BLOCK_E)
    every = tl.zeros([BLOCK_E], dtype=tl.int32)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    if PADDED:
        real = tl.load(real_ptr)
    else:
        real = n
    for c0 in range(0, n, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        live = i < n
        expert = tl.load(ids_ptr + i, mask=live, other=0).to(tl.int32)
        counts += tl.histogram(expert, BLOCK_E, mask=live & (i < real))
        if PADDED:
            every += tl.histogram(expert, BLOCK_E, mask=live)
    if not PADDED:
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
    tl.store(uses_ptr + e, tl.load(uses_ptr + e, mask=known, other=0) + (counts > 0).to(tl.int32), mask=known)
    tl.store(tail_ptr + e, addr, mask=known)
    tl.store(tail_ptr + E + e, (offsets + whole * BM).to(tl.int64), mask=known)
    tl.store(tail_ptr + 2 * E + e, tl.where(tail, rest, 0).to(tl.int64), mask=known)
    total = tl.sum(full, 0)
    for t0 in range(0, max_full, TILES):
        t = t0 + tl.arange(0, TILES)
        mine = (firsts[None, :] <= t[:, None]) & (t[:, None] < ends[None, :])  # [TILES, BLOCK_E]: its expert
        first = t - tl.sum(tl.where(mine, firsts[None, :], 0), 1)  # the tile's index within its expert
        start = tl.sum(tl.where(mine, offsets[None, :], 0), 1) + first * BM
        count = tl.minimum(tl.sum(tl.where(mine, counts[None, :], 0), 1) - first * BM, BM)
        tiled = t < total
        on = t < max_full
        tl.store(full_ptr + t, tl.sum(tl.where(mine, addr[None, :], 0), 1), mask=on)
        tl.store(full_ptr + max_full + t, tl.where(tiled, start, 0).to(tl.int64), mask=on)
        tl.store(full_ptr + 2 * max_full + t, tl.where(tiled, count, 0).to(tl.int64), mask=on)
