"""When each program of a 1-row decode's loads gets its data: per-program `%globaltimer` and `%clock64` stamps at
start and once its words are in, for one layer's 8 records read from HBM (L2 flushed before each launch). Session 20's
unmeasured reading is that every tile's data lands near the end of the launch's memory phase, because each tile spans
every HBM channel, so no tile can compute early; these stamps check it.

Cases: flat reads of 16 KB a program; gate/up tiles of the GEMV's geometry (8 rows of gate and up, 2 warps), all of K
at once or in two halves, the second issued once the first is in (staged).

python -m benchmarks.decode_arrivals
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from benchmarks.bench_kernels import QWEN3_30B, random_pool
from benchmarks.decode_floor import _xor
from moestream.experts.format import RecordLayout
from moestream.kernels.expert_mlp import _offsets


@triton.jit
def _stamp(dep):
    """(%globaltimer ns, %clock64, %smid), read once `dep` (an int32) is known."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                    pack=1)
    clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)
    return now, clock, sm


@triton.jit
def _record_stamps(stamps_ptr, start, done):
    """Row p of stamps [programs, 5]: start ns, data-in ns, start clock, data-in clock, SM."""
    at = stamps_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 5
    tl.store(at, start[0])
    tl.store(at + 1, done[0])
    tl.store(at + 2, start[1])
    tl.store(at + 3, done[1])
    tl.store(at + 4, start[2].to(tl.int64))


@triton.jit
def stamped_flat_kernel(stamps_ptr, addr_ptr, NBYTES: tl.constexpr, CHUNK: tl.constexpr):
    start = _stamp(tl.program_id(1))
    base = tl.load(addr_ptr + tl.program_id(0)).to(tl.pointer_type(tl.int32))
    w = tl.program_id(1) * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    acc = tl.reduce(tl.load(base + w, mask=w < NBYTES // 4, other=0), 0, _xor)
    _record_stamps(stamps_ptr, start, _stamp(acc))


@triton.jit
def stamped_tile_kernel(stamps_ptr, addr_ptr, off_gw, off_uw, H: tl.constexpr, BN: tl.constexpr,
                        STAGED: tl.constexpr):
    start = _stamp(tl.program_id(1))
    base = tl.load(addr_ptr + tl.program_id(0)).to(tl.pointer_type(tl.uint8))
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    HALF: tl.constexpr = H // 16
    k = tl.arange(0, HALF)
    gate = (base + off_gw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :]
    up = (base + off_uw).to(tl.pointer_type(tl.int32)) + r[:, None] * (H // 8) + k[None, :]
    first = tl.load(gate) ^ tl.load(up)
    if STAGED:  # the second half's loads wait for the first half's data
        acc = tl.reduce(tl.reduce(first, 1, _xor), 0, _xor)
        zero = tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [acc], dtype=tl.int32, is_pure=False, pack=1)
        second = tl.load(gate + HALF + zero) ^ tl.load(up + HALF + zero)  # an opaque 0: LLVM folds acc * 0
    else:
        second = tl.load(gate + HALF) ^ tl.load(up + HALF)
    _record_stamps(stamps_ptr, start, _stamp(tl.reduce(tl.reduce(first ^ second, 1, _xor), 0, _xor)))


def _summary(name: str, stamps: torch.Tensor) -> None:
    s = stamps.cpu().double()
    t0, t1 = s[:, 0] - s[:, 0].min(), s[:, 1] - s[:, 0].min()
    wait = (s[:, 3] - s[:, 2]) / 1.98e3  # clock64 cycles to us at the H200's 1,980 MHz
    q = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    pct = lambda v: " / ".join(f"{x:.2f}" for x in torch.quantile(v, q).tolist())  # noqa: E731
    print(f"{name}: {s.shape[0]} programs on {len(set(s[:, 4].tolist()))} SMs; us from the first start, p10 / p50 / "
          f"p90 / max: start {pct(t0 / 1e3)}, data in {pct(t1 / 1e3)}; a program's wait {pct(wait)}", flush=True)


def main() -> None:
    g = QWEN3_30B
    layout = RecordLayout.build("q4", g["hidden"], g["inter"])
    pool = random_pool(layout, 4 * g["experts"])
    o, rng = _offsets(layout), random.Random(2)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB written: L2 (50 MB) holds none of pool
    chunk, bn = 16384, 8
    flat = (g["top_k"], -(-layout.record_bytes // chunk))
    tiles = (g["top_k"], layout.intermediate_size // bn)

    def tile_read(staged):
        return lambda st, a, grid: stamped_tile_kernel[grid](st, a, o["gate_w"], o["up_w"], H=layout.hidden_size,
                                                             BN=bn, STAGED=staged, num_warps=2)
    cases = {
        "flat, 16 KB a program": (flat, lambda st, a, grid: stamped_flat_kernel[grid](
            st, a, NBYTES=layout.record_bytes, CHUNK=chunk, num_warps=4)),
        "gate/up tiles, all of K at once": (tiles, tile_read(0)),
        "gate/up tiles, two staged halves": (tiles, tile_read(1)),
    }
    for name, (grid, launch) in cases.items():
        stamps = torch.zeros(grid[0] * grid[1], 5, dtype=torch.int64, device="cuda")
        for trial in range(4):  # the first compiles
            addr = torch.tensor([pool[e].data_ptr() for e in rng.sample(range(pool.shape[0]), g["top_k"])],
                                device="cuda")
            flush.fill_(trial)
            launch(stamps, addr, grid)
            torch.cuda.synchronize()
        _summary(name, stamps)


if __name__ == "__main__":
    main()
