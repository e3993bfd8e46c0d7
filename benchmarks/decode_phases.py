"""What the structure of a 1-row Q4 decode step costs with no arithmetic: one Qwen3-30B-A3B layer's bytes (8 records,
21.2 MB) read in the phases a design needs, over rotating sets inside one CUDA graph.

- one phase: every byte in one launch (the read floor);
- two phases: gate/up's bytes, then down's in a dependent launch (PDL) that reads before or after its wait for the
  first: the floor of every gate/up -> down design, whatever its arithmetic;
- each real kernel pair (the GEMV pair, the mma pair) with one of its kernels replaced by that kernel's bytes alone
  (read flat, the same launch order and wait): how much of the step each kernel's own work adds;
- split by intermediate slice: program (entry, slice) reads its gate and up rows and its columns of down (strided,
  as a design with no h handoff needs), stores a partial, and a dependent launch sums the partials in fixed order.

python -m benchmarks.decode_phases [--trace]   (--trace: when each down program of the mma pair reaches each point, with
gate/up real and with its bytes alone)
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from unittest import mock

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.bench_kernels import QWEN3_30B, graphed_seconds, one_row, random_pool
from benchmarks.common import hbm_copy_gbs
from benchmarks.decode_floor import MMA_2X2, _flat_read, _layer_step, _xor
from benchmarks.decode_mma import SLOTS, replay_traced
from moestream.experts.format import RecordLayout
from moestream.kernels import expert_mlp, expert_mma
from moestream.kernels.launch import options


@triton.jit
def span_read_kernel(out_ptr, addr_ptr, OFF1: tl.constexpr, LEN1: tl.constexpr, OFF2: tl.constexpr,
                     CHUNK: tl.constexpr, FIRST: tl.constexpr, WAIT: tl.constexpr):
    """Program (e, j) reads chunk j of record e's bytes OFF1..OFF1+LEN1 and then from OFF2 on (int32 words), XORed.
    FIRST: lets the dependent launch start at once. WAIT: 1 waits for the launch before it first, 2 after its loads
    (as a down kernel whose words copy before h is ready)."""
    if WAIT == 1:
        gdc_wait()
    if FIRST:
        gdc_launch_dependents()
    start = tl.program_id(1) * CHUNK
    at = tl.where(start < LEN1, OFF1 + start, OFF2 + start - LEN1)
    base = tl.load(addr_ptr + tl.program_id(0)).to(tl.pointer_type(tl.uint8)) + at
    acc = tl.reduce(tl.load(base.to(tl.pointer_type(tl.int32)) + tl.arange(0, CHUNK // 4)), 0, _xor)
    if WAIT == 2:
        gdc_wait()
    tl.store(out_ptr + tl.program_id(0) * 0, acc)


@triton.jit
def slice_read_kernel(partial_ptr, addr_ptr, off_gw, off_uw, off_dw, off_gs, off_gb, off_us, off_ub, off_ds, off_db,
                      H: tl.constexpr, I: tl.constexpr, BI: tl.constexpr):
    """Program (e, s) reads what intermediates s * BI.. of record e need: BI gate and up rows with their scales and
    biases, and those BI columns of down with theirs (strided); stores an [H] fp32 partial of them."""
    gdc_launch_dependents()
    e, s = tl.program_id(0), tl.program_id(1)
    base = tl.load(addr_ptr + e).to(tl.pointer_type(tl.uint8))
    r = s * BI + tl.arange(0, BI)
    k = tl.arange(0, H // 8)
    gate = tl.load((base + off_gw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :])
    up = tl.load((base + off_uw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :])
    g = tl.arange(0, H // 128)  # a row's scales: H // 64 bf16, read as int32 pairs
    at = r[:, None] * (H // 128) + g[None, :]
    affine = (tl.load((base + off_gs).to(tl.pointer_type(tl.int32)) + at)
              ^ tl.load((base + off_gb).to(tl.pointer_type(tl.int32)) + at)
              ^ tl.load((base + off_us).to(tl.pointer_type(tl.int32)) + at)
              ^ tl.load((base + off_ub).to(tl.pointer_type(tl.int32)) + at))
    n = tl.arange(0, H)
    c = s * (BI // 8) + tl.arange(0, BI // 8)
    down = tl.load((base + off_dw).to(tl.pointer_type(tl.int32)) + n[:, None] * (I // 8) + c[None, :])
    ds = tl.load((base + off_ds).to(tl.pointer_type(tl.int16)) + n * (I // 64) + s * BI // 64)
    db = tl.load((base + off_db).to(tl.pointer_type(tl.int16)) + n * (I // 64) + s * BI // 64)
    mix = tl.reduce(tl.reduce(gate ^ up, 1, _xor) ^ tl.reduce(affine, 1, _xor), 0, _xor)
    y = tl.reduce(down, 1, _xor) ^ (ds.to(tl.int32) ^ db.to(tl.int32)) ^ mix
    tl.store(partial_ptr + (e * tl.num_programs(1) + s) * H + n, y.to(tl.float32))


@triton.jit
def partial_sum_kernel(partial_ptr, out_ptr, SLICES: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
    """Program (e, j): out[e, j * BH..] = the sum of entry e's SLICES partials there, in slice order (launched as a
    dependent: it waits for them)."""
    gdc_wait()
    e, n = tl.program_id(0), tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for s in tl.static_range(SLICES):
        acc += tl.load(partial_ptr + (e * SLICES + s) * H + n)
    tl.store(out_ptr + e * H + n, acc.to(tl.bfloat16))


def _spans(layout: RecordLayout) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(words' offset, their length, the scales' and biases' offset, all bytes) of gate/up and of down: a record
    holds every matrix's words, then every matrix's scales and biases."""
    at = {f.name: f for f in layout.fields}
    words = at["up_w"].offset + at["up_w"].nbytes - at["gate_w"].offset
    gate_up = (at["gate_w"].offset, words, at["gate_s"].offset, words + 4 * at["gate_s"].nbytes)
    down = (at["down_w"].offset, at["down_w"].nbytes, at["down_s"].offset,
            at["down_w"].nbytes + 2 * at["down_s"].nbytes)
    return gate_up, down


class _BytesOnly:
    """Stands in for a Triton kernel: `kernel[grid](*args)` launches `read(args[index])` (the addresses) instead."""

    def __init__(self, read, index: int):
        self.read, self.index = read, index

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.read(args[self.index])


def _with_bytes_only(step, module: str, kernel: str, read, index: int):
    """`step` with `module.kernel` read by its bytes alone: patched while a graph captures it, so it records the
    stand-in's launch."""
    def run(a):
        with mock.patch(f"{module}.{kernel}", _BytesOnly(read, index)):
            step(a)
    return run


def _phase_reads(sink, layout: RecordLayout, top_k: int, wait: int = 2, chunk: int = 32768):
    """(gate/up's bytes read flat, down's read flat as a dependent that waits for it before (`wait` 1) or after (2)
    its loads): a -> launch."""
    (g1, g_len, g2, g_all), (d1, d_len, d2, d_all) = _spans(layout)
    g_grid, d_grid = (top_k, g_all // chunk), (top_k, d_all // chunk)
    return (lambda a: span_read_kernel[g_grid](sink, a, OFF1=g1, LEN1=g_len, OFF2=g2, CHUNK=chunk, FIRST=True, WAIT=0,
                                               num_warps=8),
            lambda a: span_read_kernel[d_grid](sink, a, OFF1=d1, LEN1=d_len, OFF2=d2, CHUNK=chunk, FIRST=False,
                                               WAIT=wait, num_warps=8, **options(True)))


def _two_phases(sink, layout: RecordLayout, top_k: int, wait: int):
    """A step of gate/up's bytes, then down's in a dependent launch (`_phase_reads`)."""
    gate_up, down = _phase_reads(sink, layout, top_k, wait)

    def step(a):
        gate_up(a)
        down(a)
    return step


def _decomposed(sink, layout: RecordLayout, top_k: int) -> dict:
    """The GEMV and mma pairs whole, and each with gate/up's or down's kernel replaced by its bytes alone."""
    gate_up, down = _phase_reads(sink, layout, top_k)
    step = _layer_step(layout, top_k)
    steps = {}
    for name, cfg, module, kernels, index in (
            ("GEMV pair", expert_mlp.tile_config("decode", layout), "moestream.kernels.triton.expert_gemv",
             ("gate_up_gemv_kernel", "down_gemv_kernel"), 3),
            ("mma pair 2 + 2 warps, 3 stages", MMA_2X2, "moestream.kernels.triton.expert_mma",
             ("gate_up_mma_kernel", "down_mma_kernel"), 4)):
        steps[name] = step(cfg)
        steps[f"{name}, down's bytes alone"] = _with_bytes_only(step(cfg), module, kernels[1], down, index)
        steps[f"{name}, gate/up's bytes alone"] = _with_bytes_only(step(cfg), module, kernels[0], gate_up, index)
    return steps


def trace_down(sink, layout: RecordLayout, sets: list, top_k: int) -> None:
    """The mma pair (2 + 2 warps, 3 stages), 1 row, back to back in one graph: for the middle step, each down
    point's time after its first down program started, in quantiles over the programs (us), with gate/up real and
    with its bytes alone; then the step before's last down store and this step's first gate/up start."""
    x, out, entries = one_row(layout, top_k)
    warps = 2
    programs = (top_k * layout.intermediate_size // (8 * warps), top_k * layout.hidden_size // (16 * warps))
    stamps = [tuple(torch.zeros(p, 8, dtype=torch.int64, device="cuda") for p in programs) for _ in sets]
    step = functools.partial(expert_mma.launch_decode_mma, x, out, entries, layout=layout, top_k=top_k,
                             offsets=expert_mlp._offsets(layout), warps=warps, warps_down=warps, stages=3)
    q = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    gate_up, _ = _phase_reads(sink, layout, top_k)
    for how in ("gate/up real", "gate/up's bytes alone"):
        real = how == "gate/up real"
        with contextlib.nullcontext() if real else mock.patch(
                "moestream.kernels.triton.expert_mma.gate_up_mma_kernel", _BytesOnly(gate_up, 4)):
            (gu, down), previous = replay_traced(step, sets, stamps)
        t0 = down[:, 0].min()
        before = (previous[1][:, 6].max() - t0) / 1e3
        first_gu = (gu[:, 0].min() - t0) / 1e3 if real else float("nan")
        print(f"down, {how}: the step before stored its last at {before:.2f} us, gate/up started at {first_gu:.2f}; "
              "quantiles 0/10/50/90/100%:")
        for slot, label in enumerate(SLOTS):
            v = torch.quantile((down[:, slot] - t0).double() / 1e3, q).tolist()
            print(f"  {label:17s} " + " ".join(f"{u:6.2f}" for u in v))
        if real:
            print(f"  gate/up stored    {(gu[:, 6].max() - t0) / 1e3:6.2f} (its last)")
        for t in stamps:
            for part in t:
                part.zero_()


def _sliced(layout: RecordLayout, records: int, bi: int, warps: int, reduce: bool):
    """A step of slice programs (`slice_read_kernel`), then (`reduce`) the partials summed by a dependent launch."""
    slices, hidden = layout.intermediate_size // bi, layout.hidden_size
    partials = torch.empty(records * slices, hidden, device="cuda", dtype=torch.float32)
    out = torch.empty(records, hidden, device="cuda", dtype=torch.bfloat16)
    offsets = [{f.name: f.offset for f in layout.fields}[n] for n in
               ("gate_w", "up_w", "down_w", "gate_s", "gate_b", "up_s", "up_b", "down_s", "down_b")]

    def step(a):
        slice_read_kernel[(records, slices)](partials, a, *offsets, H=hidden, I=layout.intermediate_size, BI=bi,
                                             num_warps=warps)
        if reduce:
            partial_sum_kernel[(records, hidden // 256)](partials, out, SLICES=slices, H=hidden, BH=256, num_warps=2,
                                                         **options(True))
    return step


def main() -> None:
    g = QWEN3_30B
    layout = RecordLayout.build("q4", g["hidden"], g["inter"])
    sink = torch.empty(1, dtype=torch.int32, device="cuda")
    pool = random_pool(layout, 4 * g["experts"])
    rng = random.Random(1)
    sets = [torch.tensor([pool[e].data_ptr() for e in rng.sample(range(pool.shape[0]), g["top_k"])], device="cuda")
            for _ in range(64)]
    layer = g["top_k"] * layout.record_bytes
    if "--trace" in sys.argv:
        return trace_down(sink, layout, sets[:32], g["top_k"])
    copy = hbm_copy_gbs()  # 8 GB of buffers and a few timed copies: only the timed steps need it
    print(f"HBM copy {copy:.0f} GB/s; the layer {layer / 1e6:.1f} MB a step; 60% of copy: "
          f"{layer / (0.6 * copy * 1e3):.2f} us")
    gate_up_bytes = g["top_k"] * _spans(layout)[0][3]
    print(f"gate/up's bytes alone (words, scales, biases: {gate_up_bytes / 1e6:.1f} MB): "
          f"{graphed_seconds(_phase_reads(sink, layout, g['top_k'])[0], sets) * 1e6:.2f} us a step")
    steps = {"one phase, 64 KB a program": _flat_read(sink, g["top_k"], layout.record_bytes // 64 * 64, 65536, 8),
             "two phases, down reads after its wait": _two_phases(sink, layout, g["top_k"], 1),
             "two phases, down reads before its wait": _two_phases(sink, layout, g["top_k"], 2),
             **_decomposed(sink, layout, g["top_k"])}
    for bi, warps in ((64, 16), (32, 8)):
        for reduce in (False, True):
            name = f"slices of {bi}, {warps} warps{', partials summed after' if reduce else ', no sum'}"
            steps[name] = _sliced(layout, g["top_k"], bi, warps, reduce)
    for name, fn in steps.items():
        us = graphed_seconds(fn, sets) * 1e6
        print(f"{name}: {us:.2f} us a step ({layer / us / 1e3 / copy:.0%} of copy at the layer's bytes)", flush=True)


if __name__ == "__main__":
    main()
