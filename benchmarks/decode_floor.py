"""Where the 1-row Q4 decode's time goes, over rotating expert sets inside one CUDA graph: the tensor-core gate/up
kernel against kernels that only copy in and read the same words (its memory floor) or load them in whole lines,
and XOR them; then a whole layer's step
(the GEMV pair, fused in one launch, on tensor cores) against one launch that reads its 8 records' bytes flat,
in whole lines; each from HBM and with its records in L2.

python -m benchmarks.decode_floor [--layer | --scaling | --pools]   (--pools: steps over pools of 512, 128 and
40 records, whether the address span sets the floor; --layer: the whole-layer part only; --scaling: one
launch's flat read of the first 20-100% of each of 8 records, 64 KB a program, and the line through them: what a
launch costs beyond its bytes, and its rate)
"""

from __future__ import annotations

import dataclasses
import random
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.bench_kernels import QWEN3_30B, graphed_seconds, one_row, random_pool
from benchmarks.common import hbm_copy_gbs
from moestream.experts.format import RecordLayout
from moestream.kernels import expert_mlp, expert_mma
from moestream.kernels.expert_mlp import TileConfig, _offsets
from moestream.kernels.launch import options
from moestream.kernels.triton.expert_mma import (
    CHUNK,
    copy_stage,
    group_words,
    matrix_rows,
    record_of,
    stage_in,
    word_buffers,
)
from moestream.kernels.triton.launch import dependent_start


@gluon.jit
def words_only_kernel(out_ptr, entries_ptr, addr_ptr, off_gw, off_uw, H: gl.constexpr, STAGES: gl.constexpr,
                      LDG: gl.constexpr, WORDS: gl.constexpr, COPY: gl.constexpr, STAGE: gl.constexpr):
    """The gate/up kernel's word copies and fragment reads (STAGES in flight, 0: all), XORed: what its step costs
    with no arithmetic. LDG: each stage loads into registers (the same lanes and bytes as the async copies) and is
    stored to shared memory once in, so loads, not cp.async, deliver it."""
    R: gl.constexpr = 16 * gl.num_warps()
    G: gl.constexpr = H // 64
    NS: gl.constexpr = triton.cdiv(G, CHUNK)
    S: gl.constexpr = NS if STAGES == 0 or STAGES >= NS else STAGES
    e, base = record_of(entries_ptr, addr_ptr, entries_ptr, False)
    words, _, _ = matrix_rows(base, off_gw, 0, 0, gl.program_id(1) * (R // 2), H, R, COPY, STAGE, True, off_uw, 0, 0)
    buffers, by_group = word_buffers(S, R)
    acc = gl.zeros([R, 8], gl.int32, WORDS)
    if LDG:
        gl.static_assert(G % CHUNK == 0, "whole stages only")
        staged = ()
        for c in gl.static_range(S):
            staged = staged + (gl.load(words + c * CHUNK * 8),)
        for c in gl.static_range(NS):
            if c + S < NS + 1 and c > 0:  # the stage S - 1 on loads once this one is needed
                staged = staged + (gl.load(words + (c + S - 1) * CHUNK * 8),)
            buffers.slice(c % S * CHUNK, CHUNK).store(staged[c])
            gl.thread_barrier()
            for g in gl.static_range(c * CHUNK, c * CHUNK + CHUNK):
                acc = acc ^ group_words(by_group, g, S, R, WORDS)
            gl.thread_barrier()  # every warp past this buffer before a later stage is stored in it
    else:
        for c in gl.static_range(S):
            copy_stage(buffers.slice(c * CHUNK, CHUNK), words, c, G, COPY)
        for g in gl.static_range(G):
            if g % CHUNK == 0:
                stage_in(buffers, words, g // CHUNK, S, NS, G, COPY)
            acc = acc ^ group_words(by_group, g, S, R, WORDS)
    gl.store(out_ptr + (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * 0, gl.max(gl.max(acc, 1), 0))


@triton.jit
def rows_whole_kernel(out_ptr, addr_ptr, off_gw, off_uw, H: tl.constexpr, RB: tl.constexpr):
    """The same words, read row by row in whole 128-byte lines (Triton's coalesced layout), XORed."""
    base = tl.load(addr_ptr + tl.program_id(0)).to(tl.pointer_type(tl.uint8))
    r = tl.program_id(1) * RB + tl.arange(0, RB)
    k = tl.arange(0, H // 8)
    gate = tl.load((base + off_gw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :])
    up = tl.load((base + off_uw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :])
    acc = tl.reduce(gate ^ up, 1, _xor)
    tl.store(out_ptr + tl.program_id(0) * 0, tl.max(acc, 0))


@triton.jit
def flat_read_kernel(out_ptr, addr_ptr, NBYTES: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (e, j) reads bytes j * CHUNK.. of record e (int32 words, whole lines, masked past NBYTES), XORed.
    PDL: launched as a dependent, it waits for the step before only once resident."""
    dependent_start(PDL)
    base = tl.load(addr_ptr + tl.program_id(0)).to(tl.pointer_type(tl.int32))
    w = tl.program_id(1) * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    acc = tl.reduce(tl.load(base + w, mask=w < NBYTES // 4, other=0), 0, _xor)
    tl.store(out_ptr + tl.program_id(0) * 0, acc)


@triton.jit
def persistent_read_kernel(out_ptr, addr_ptr, RECORDS: tl.constexpr, NBYTES: tl.constexpr, CHUNK: tl.constexpr,
                           PDL: tl.constexpr):
    """The same bytes from one program an SM: chunk c of the record-major list goes to program c % grid, the next
    chunk's loads issued before this one is reduced (what a persistent kernel's loads can deliver)."""
    dependent_start(PDL)
    PER: tl.constexpr = (NBYTES + CHUNK - 1) // CHUNK
    w = tl.arange(0, CHUNK // 4)
    acc = tl.zeros((CHUNK // 4,), dtype=tl.int32)
    c = tl.program_id(0)
    base = tl.load(addr_ptr + c // PER).to(tl.pointer_type(tl.int32))
    ahead = tl.load(base + c % PER * (CHUNK // 4) + w, mask=c % PER * (CHUNK // 4) + w < NBYTES // 4, other=0)
    for c in range(tl.program_id(0), RECORDS * PER, tl.num_programs(0)):
        data = ahead
        n = c + tl.num_programs(0)
        if n < RECORDS * PER:
            base = tl.load(addr_ptr + n // PER).to(tl.pointer_type(tl.int32))
            ahead = tl.load(base + n % PER * (CHUNK // 4) + w, mask=n % PER * (CHUNK // 4) + w < NBYTES // 4,
                            other=0)
        acc ^= data
    tl.store(out_ptr + tl.program_id(0) * 0, tl.reduce(acc, 0, _xor))


@gluon.jit
def tma_read_kernel(out_ptr, desc, addr_ptr, pool_base, NBYTES: gl.constexpr, COPIES: gl.constexpr,
                    PDL: gl.constexpr):
    """Program (e, j) copies COPIES boxes of the pool's 128-byte rows (TMA, one mbarrier) from bytes j * COPIES *
    box.. of record e (up to NBYTES) and waits for them: what the tensor memory accelerator delivers."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    ROWS: gl.constexpr = desc.block_type.shape[0]
    first = ((gl.load(addr_ptr + gl.program_id(0)) - pool_base) // 128).to(gl.int32) + gl.program_id(1) * COPIES * ROWS
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    bufs = gl.allocate_shared_memory(gl.int32, [COPIES, ROWS, 32], desc.layout)
    mbarrier.expect(bar, COPIES * ROWS * 128)
    for c in gl.static_range(COPIES):
        tma.async_copy_global_to_shared(desc, [first + c * ROWS, 0], bar, bufs.index(c))
    mbarrier.wait(bar, 0)
    gl.store(out_ptr, first, mask=first < 0)  # nothing: the copies are the work


def _tma_read(sink, pool, records: int, nbytes: int, rows: int, copies: int, pdl: bool = False):
    """A step reading bytes 0..nbytes of each record by TMA boxes of `rows` 128-byte rows, `copies` a program."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = pool.view(torch.int32).view(-1, 32)
    desc = TensorDescriptor.from_tensor(flat, [rows, 32], gl.NVMMASharedLayout.get_default_for([rows, 32], gl.int32))
    grid = (records, -(-nbytes // (rows * 128 * copies)))
    return lambda a: tma_read_kernel[grid](sink, desc, a, pool.data_ptr(), NBYTES=nbytes, COPIES=copies, PDL=pdl,
                                           num_warps=1, **options(pdl))


@triton.jit
def empty_kernel(out_ptr, addr_ptr, PDL: tl.constexpr):
    """Reads one address and stores nothing: a step's launch and nothing else."""
    dependent_start(PDL)
    if tl.load(addr_ptr) == 0:
        tl.store(out_ptr, 1)


@triton.jit
def _xor(a, b):
    return a ^ b


def _flat_read(sink, records: int, nbytes: int, chunk: int, warps: int, pdl: bool = False):
    """A step reading bytes 0..nbytes of each of `records` records at addresses a, `chunk` bytes a program."""
    grid = (records, -(-nbytes // chunk))
    return lambda a: flat_read_kernel[grid](sink, a, NBYTES=nbytes, CHUNK=chunk, PDL=pdl, num_warps=warps,
                                            **options(pdl))


def scaling(layout, sets, sink, pool) -> None:
    """Flat reads of the first part of each record (gate/up's words are the first 59%): us a step against MB,
    and the least-squares line through them; then, plain and launched as dependents (PDL): a step that reads
    nothing, the whole records read flat, by TMA boxes, and by one or two programs an SM."""
    points = []
    for frac in (0.2, 0.4, 0.59, 0.8, 1.0):
        nbytes = int(frac * layout.record_bytes) // 64 * 64
        us = graphed_seconds(_flat_read(sink, len(sets[0]), nbytes, 65536, 8), sets) * 1e6
        points.append((len(sets[0]) * nbytes / 1e6, us))
        print(f"flat read of {points[-1][0]:.1f} MB, 64 KB a program: {us:.2f} us a step", flush=True)
    mb, us = torch.tensor(points, dtype=torch.float64).T
    slope = ((mb - mb.mean()) * (us - us.mean())).sum() / ((mb - mb.mean()) ** 2).sum()
    print(f"line: {us.mean() - slope * mb.mean():.2f} us + MB at {1 / slope:.2f} TB/s")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes, records = layout.record_bytes // 64 * 64, len(sets[0])
    for pdl in (False, True):
        cases = {"nothing, 1 program": lambda a, d=pdl: empty_kernel[(1,)](sink, a, PDL=d, **options(d)),
                 f"nothing, {sms} programs": lambda a, d=pdl: empty_kernel[(sms,)](sink, a, PDL=d, **options(d)),
                 "flat read, 64 KB a program": _flat_read(sink, records, nbytes, 65536, 8, pdl),
                 "flat read of 20%": _flat_read(sink, records, nbytes // 5 // 64 * 64, 65536, 8, pdl)}
        for rows, copies in ((256, 1), (128, 1), (256, 2), (128, 4)):
            cases[f"TMA, {rows * copies // 8} KB a program in {copies}"] = _tma_read(sink, pool, records, nbytes, rows,
                                                                                     copies, pdl)
        cases["TMA of 20%, 32 KB a program"] = _tma_read(sink, pool, records, nbytes // 5, 256, 1, pdl)
        for chunk, warps, per_sm in ((16384, 8, 1), (32768, 8, 1), (16384, 4, 2), (32768, 8, 2)):
            cases[f"persistent, {per_sm} an SM, {chunk // 1024} KB chunks, {warps} warps"] = (
                lambda a, c=chunk, w=warps, p=per_sm, d=pdl: persistent_read_kernel[(p * sms,)](
                    sink, a, RECORDS=records, NBYTES=nbytes, CHUNK=c, PDL=d, num_warps=w, **options(d)))
        for name, fn in cases.items():
            us = graphed_seconds(fn, sets) * 1e6
            print(f"{'PDL' if pdl else 'plain'}, {name}: {us:.2f} us a step", flush=True)


MMA_2X2 = TileConfig(1, 8, 2048, 16, 1024, 2, 3, 0, 2, mma=1)  # the mma pair: 2 + 2 warps, 3 copy stages


def _layer_step(layout, top_k: int):
    """cfg -> a 1-row layer step through `launch_decode` with those tiles, reading the records at addresses a."""
    x, out, entries = one_row(layout, top_k)
    h = torch.empty(top_k, layout.intermediate_size, device="cuda", dtype=torch.bfloat16)
    return lambda cfg: lambda a: expert_mlp.launch_decode(x, out, entries, a, layout, top_k, h=h, cfg=cfg)


def pools(layout, sink, top_k: int) -> None:
    """The same steps over pools of 512, 128 (one layer) and 40 records, in disjoint sets of 8 taken in turn (a
    record comes back only after all the others, so L2 cannot serve it): whether the bytes' address span (the
    TLB's reach) sets a step's floor."""
    step = _layer_step(layout, top_k)
    nbytes = layout.record_bytes // 64 * 64
    steps = {"flat read of 20%": _flat_read(sink, top_k, nbytes // 5 // 64 * 64, 65536, 8),
             "flat read": _flat_read(sink, top_k, nbytes, 65536, 8),
             "GEMV pair": step(expert_mlp.tile_config("decode", layout)),
             "mma pair, 2 + 2 warps, 3 stages": step(MMA_2X2)}
    for records in (512, 128, 40):
        pool = random_pool(layout, records)
        order = torch.randperm(records, generator=torch.Generator().manual_seed(records)).tolist()
        sets = [torch.tensor([pool[order[(i * top_k + k) % records]].data_ptr() for k in range(top_k)],
                             device="cuda") for i in range(64)]
        for name, fn in steps.items():
            print(f"{records} records, {name}: {graphed_seconds(fn, sets) * 1e6:.2f} us a step", flush=True)
        del pool, sets


def main() -> None:
    g = QWEN3_30B
    layout = RecordLayout.build("q4", g["hidden"], g["inter"])
    sink = torch.empty(1, dtype=torch.int32, device="cuda")
    gate_up_bytes = 2 * layout.intermediate_size * layout.hidden_size // 2
    print(f"HBM copy {hbm_copy_gbs():.0f} GB/s; gate/up words {g['top_k'] * gate_up_bytes / 1e6:.1f} MB a step")
    if "--pools" in sys.argv:  # builds its own pools: none of the 512 records below
        return pools(layout, sink, g["top_k"])
    pool = random_pool(layout, 4 * g["experts"])
    rng = random.Random(1)
    sets = [torch.tensor([pool[e].data_ptr() for e in rng.sample(range(pool.shape[0]), g["top_k"])], device="cuda")
            for _ in range(64)]
    x, out, entries = one_row(layout, g["top_k"])
    o = _offsets(layout)
    if "--scaling" in sys.argv:
        return scaling(layout, sets, sink, pool)
    for warps, stages in () if "--layer" in sys.argv else ((2, 0), (2, 3), (4, 0), (4, 3), (8, 2)):
        L = expert_mma._layouts(warps)
        cases = {
            **{f"words only, stages {stages}, {how}": lambda a, w=warps, s=stages, L=L, ldg=ldg: words_only_kernel[
                (g["top_k"], layout.intermediate_size // (8 * w))](
                sink, entries, a, o["gate_w"], o["up_w"], H=layout.hidden_size, STAGES=s, LDG=ldg, WORDS=L["WORDS"],
                COPY=L["COPY"], STAGE=L["STAGE"], num_warps=w) for ldg, how in ((0, "cp.async"), (1, "LDG"))},
            f"whole step, stages {stages}": lambda a, w=warps, s=stages: expert_mma.launch_decode_mma(
                x, out, entries, a, layout, g["top_k"], o, w, 4, stages=s),
            "whole lines": lambda a, w=warps: rows_whole_kernel[(g["top_k"], layout.intermediate_size // (8 * w))](
                sink, a, o["gate_w"], o["up_w"], H=layout.hidden_size, RB=8 * w, num_warps=w),
        }
        for name, fn in cases.items():
            us, l2 = graphed_seconds(fn, sets) * 1e6, graphed_seconds(fn, sets[:1] * len(sets)) * 1e6
            rate = g["top_k"] * gate_up_bytes / us / 1e3
            print(f"warps {warps}, {name}: {us:.1f} us a step, words at {rate:.0f} GB/s; L2 {l2:.1f} us", flush=True)
    layer_bytes = g["top_k"] * layout.record_bytes
    tiles = expert_mlp.tile_config("decode", layout)
    step = _layer_step(layout, g["top_k"])
    steps = {f"GEMV pair {tiles}": step(dataclasses.replace(tiles, fused=0)),
             "fused (16, 2048, 32, 1024), 4 warps": step(TileConfig(1, 16, 2048, 32, 1024, 4, 1, fused=1)),
             "mma pair, 4 + 4 warps": step(TileConfig(1, 8, 2048, 16, 1024, 4, 1, 0, 4, mma=1)),
             "mma pair, 2 + 2 warps, 3 stages": step(MMA_2X2)}
    for chunk, warps in [(8192, 4), (16384, 4), (32768, 4), (32768, 8), (65536, 8)]:
        steps[f"flat read, {chunk // 1024} KB a program, {warps} warps"] = _flat_read(sink, g["top_k"],
                                                                                   layout.record_bytes, chunk, warps)
    # the same 8 records every step stay in L2 (50 MB): what a step costs when HBM is not the limit
    print(f"whole layer: {layer_bytes / 1e6:.1f} MB a step, from HBM (rotating sets) and from L2 (one set)")
    for name, fn in steps.items():
        hbm, l2 = graphed_seconds(fn, sets) * 1e6, graphed_seconds(fn, sets[:1] * len(sets)) * 1e6
        print(f"{name}: HBM {hbm:.1f} us a step ({layer_bytes / hbm / 1e3:.0f} GB/s), L2 {l2:.1f} us", flush=True)

if __name__ == "__main__":
    main()
