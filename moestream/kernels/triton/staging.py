"""Staging a batched decode step's host-tier records: each expert of the step's union that lives in pinned host
memory is copied over PCIe once into a device slot, so that the rows routed to it read it from HBM (a kernel
reading host memory in place fetches it again for every routing entry; the GPU's caches do not merge them)."""

import triton
import triton.language as tl


@triton.jit
def stage_plan_kernel(table_ptr, ids_ptr, staged_ptr, sources_ptr, n, host_base, host_end, slot_base,
                      SLOT_STRIDE: tl.constexpr, CAPACITY: tl.constexpr, NP: tl.constexpr):
    """One program. For each distinct id of ids[:n] (its first entry j): staged[id] = the device slot of its rank
    among the distinct host-tier ids when that is below CAPACITY, else table[id] (read in place); sources[r] = the
    host address slot r copies from (0: nothing)."""
    j = tl.arange(0, NP)
    live = j < n
    ids = tl.load(ids_ptr + j, mask=live, other=-1)
    src = tl.load(table_ptr + ids, mask=live, other=0)
    # first occurrence: no earlier entry with the same id
    earlier = (ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])
    first = live & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    host = first & (src >= host_base) & (src < host_end)
    rank = tl.cumsum(host.to(tl.int32), axis=0) - host.to(tl.int32)
    staged = host & (rank < CAPACITY)
    addr = tl.where(staged, slot_base + rank.to(tl.int64) * SLOT_STRIDE, src)
    tl.store(staged_ptr + ids, addr, mask=first)
    r = tl.arange(0, CAPACITY)
    hit = (rank[None, :] == r[:, None]) & staged[None, :]
    tl.store(sources_ptr + r, tl.sum(tl.where(hit, src[None, :], 0), axis=1))


@triton.jit
def stage_copy_kernel(sources_ptr, slot_base, SLOT_STRIDE: tl.constexpr, NBYTES: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, c): bytes c * CHUNK .. of slot r's record, 16 at a time, from sources[r] (0: nothing)."""
    r, c = tl.program_id(0), tl.program_id(1)
    src = tl.load(sources_ptr + r)
    if src == 0:
        return
    src_words = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
    dst_words = tl.multiple_of((slot_base + r.to(tl.int64) * SLOT_STRIDE).to(tl.pointer_type(tl.int32)), 16)
    for start in range(c * CHUNK // 4, (c + 1) * CHUNK // 4, BLOCK):
        w = start + tl.arange(0, BLOCK)
        live = w < NBYTES // 4
        tl.store(dst_words + w, tl.load(src_words + w, mask=live), mask=live)
