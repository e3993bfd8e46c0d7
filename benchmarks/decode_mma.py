"""1- and 4-row Q4 decode of one Qwen3-30B-A3B layer: the tensor-core kernels (warps, copy stages) against the
tuned GEMV pair, each over rotating expert sets in one CUDA graph (and at 1 row from L2: one set
repeated), with each kernel's own time, in one run.

python -m benchmarks.decode_mma [--trace] [--trigger]   (--trace: when each program of one step reaches each point;
--trigger: the down kernel launched once gate/up has 0-8 copy stages in, so its copies compete less)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sys

import torch

from benchmarks.bench_kernels import QWEN3_30B, _error, decode_case, graphed_seconds, one_row, random_pool
from benchmarks.common import hbm_copy_gbs
from moestream.experts.format import RecordLayout
from moestream.kernels import expert_mlp, expert_mma
from moestream.kernels.expert_mlp import TileConfig

# (gate/up warps, down warps, copy stages in flight (1: all))
MMA = [(2, 2, 3), (2, 4, 3), (2, 2, 2), (2, 2, 1), (4, 4, 3), (4, 2, 3), (8, 4, 2)]
TRIGGERS = [0, 1, 2, 3, 4, 6, 8]  # gate/up's copy stages in when the down kernel may launch (of 8 at H 2048)


def _l2_us(layout, pool, cfg) -> float:
    """One row's step with the same 8 records every time (they stay in L2)."""
    g = QWEN3_30B
    x, out, entries = one_row(layout, g["top_k"])
    addr = torch.tensor([pool[e].data_ptr() for e in range(g["top_k"])], device="cuda")
    step = functools.partial(expert_mlp.launch_decode, x, out, entries, layout=layout, top_k=g["top_k"], cfg=cfg)
    return graphed_seconds(lambda a: step(addr=a), [addr] * 64) * 1e6


SLOTS = ["start", "issued", "operands in smem", "stage 0 in", "last stage in", "computed", "stored"]


def replay_traced(step, sets: list, stamps: list) -> tuple[list, list]:
    """step(addr=a, trace=t) for a, t in `sets`, `stamps` back to back in one CUDA graph, replayed once: the middle
    step's stamps and the step before's, on the host."""
    for a, t in zip(sets[:2], stamps):
        step(addr=a, trace=t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a, t in zip(sets, stamps):
            step(addr=a, trace=t)
    graph.replay()
    torch.cuda.synchronize()
    mid = len(sets) // 2
    return [t.cpu() for t in stamps[mid]], [t.cpu() for t in stamps[mid - 1]]


def trace(layout, pool, warps: int, warps_down: int, stages: int, trigger: int = 0) -> None:
    """Steps of 1 row back to back in one CUDA graph over rotating expert sets (from HBM), and then one set
    repeated (from L2): for the middle step, each point's time after its first gate/up program started, in
    quantiles over the programs (us), for both kernels; then the previous step's last store."""
    g = QWEN3_30B
    x, out, entries = one_row(layout, g["top_k"])
    rng = random.Random(2)
    sets = [torch.tensor([pool[e].data_ptr() for e in rng.sample(range(pool.shape[0]), g["top_k"])], device="cuda")
            for _ in range(32)]
    programs = (g["top_k"] * layout.intermediate_size // (8 * warps),
                g["top_k"] * layout.hidden_size // (16 * warps_down))
    stamps = [tuple(torch.zeros(p, 8, dtype=torch.int64, device="cuda") for p in programs) for _ in sets]
    step = functools.partial(expert_mma.launch_decode_mma, x, out, entries, layout=layout, top_k=g["top_k"],
                             offsets=expert_mlp._offsets(layout), warps=warps, warps_down=warps_down, stages=stages,
                             trigger=trigger)
    q = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    for where, chosen in (("HBM", sets), ("L2", sets[:1] * len(sets))):
        host, previous = replay_traced(step, chosen, stamps)
        t0 = host[0][:, 0].min()
        before = (previous[1][:, 6].max() - t0) / 1e3
        pdl = os.environ.get("MOESTREAM_PDL", "down")
        print(f"mma {warps}+{warps_down} warps, stages {stages}, trigger {trigger}, PDL {pdl}, from {where}: "
              f"the step before stored its last at {before:.2f} us; quantiles 0/10/50/90/100%:")
        for name, s in zip(("gate/up", "down"), host):
            for slot, label in enumerate(SLOTS):
                t = torch.quantile((s[:, slot] - t0).double() / 1e3, q).tolist()
                print(f"  {name:7s} {label:17s} " + " ".join(f"{v:6.2f}" for v in t))
            print(f"  {name:7s} programs an SM: {s.shape[0] / s[:, 7].unique().numel():.2f}")


def main() -> None:
    g = QWEN3_30B
    layout = RecordLayout.build("q4", g["hidden"], g["inter"])
    pool = random_pool(layout, 4 * g["experts"])
    if "--trace" in sys.argv:
        for cfg in [(2, 2, 3, t) for t in (0, 2, 4)] if "--trigger" in sys.argv else [(2, 2, 3), (2, 2, 1), (2, 4, 3)]:
            trace(layout, pool, *cfg)
        return
    copy = hbm_copy_gbs()
    print(f"HBM copy {copy:.0f} GB/s; a layer's step reads {g['top_k'] * layout.record_bytes / 1e6:.1f} MB a row")
    tuned = dataclasses.replace(expert_mlp.tile_config("decode", layout), fused=0)
    first = None
    mma = ([(w, wd, s, t) for w, wd, s in MMA[:2] for t in TRIGGERS] if "--trigger" in sys.argv else
           [(w, wd, s, 0) for w, wd, s in MMA])
    for cfg in [tuned] + [TileConfig(1, 8, 2048, 16, 1024, w, s, 0, wd, mma=1, trigger=t) for w, wd, s, t in mma]:
        try:
            runs = [decode_case(layout, pool, rows, g["top_k"], cfg, split=True) for rows in (1, 4)]
            l2 = _l2_us(layout, pool, cfg)
        except Exception as e:  # a config that does not compile or fit
            print(f"skip {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        outs = [r.pop("out").float() for r in runs]
        first = first or outs
        name = ("GEMV pair (tuned)" if cfg is tuned else
                f"mma {cfg.num_warps}+{cfg.down[0]} warps, stages {cfg.num_stages}, trigger {cfg.trigger}")
        parts = "; ".join(f"{r['rows']} rows {r['us']:.1f} us = {r['gbs'] / copy:.0%} ("
                          + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("_us")) + ")"
                          for r in runs)
        print(f"{name}: {parts}; 1 row from L2 {l2:.1f} us; error against the GEMV {_error(outs, first):.2g}",
              flush=True)


if __name__ == "__main__":
    main()
