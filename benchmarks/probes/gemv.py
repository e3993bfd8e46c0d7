"""The dense projections of a decode step at the flagship's shapes: the one-row Triton GEMV, the batch-invariant
row kernel (1, 2, 5 and 16 rows) and cuBLAS, each over weight copies that together exceed the L2 (so HBM serves
them), as GB/s of weights read, timed as CUDA graph replays. Prints one line per shape; with --sweep, the row
kernel's tiles at one row.

python -m benchmarks.probes.gemv [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from moestream.kernels.dense_gemv import RowsTile, dense_gemv, dense_rows

SHAPES = {  # (N, K): qwen4_exp's decode projections
    "deltanet in [qkv|z|b|a]": (16480, 2560),
    "deltanet out": (2560, 6144),
    "hc [down|inject]": (324, 10240),
    "hc up": (10240, 320),
    "router + shared gate/up": (1793, 2560),
    "shared down": (2560, 640),
    "attention [q|k|v]": (9216, 2560),
    "lm_head": (248320, 2560),
}


def rate(fn, weights: list[torch.Tensor]) -> float:
    """GB/s of one call over each weight copy in turn, captured as one CUDA graph (as a decode step runs them)."""
    for w in weights:  # compiled, and the graph's pool warmed
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median") / len(weights)
    return weights[0].numel() * 2 / ms / 1e6


def sweep(name: str, weights: list[torch.Tensor], x: torch.Tensor) -> None:
    found = []
    for bn, bk, stages, programs in itertools.product((16, 32, 64), (128, 256, 512), (2, 3, 4), (1024, 2048)):
        tile = RowsTile(bn, bk, 4, stages, programs)
        try:
            found.append((rate(lambda w, t=tile: dense_rows(x[:1], w, None, tile=t), weights), tile))
        except triton.runtime.errors.OutOfResources:
            continue
    found.sort(key=lambda f: -f[0])
    print(f"  {name}: " + "; ".join(f"{r:.0f} {t}" for r, t in found[:3]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(8, -(-200 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(16, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        cells = {"gemv 1": rate(lambda w, x=x: dense_gemv(x[:1], w, None), weights),
                 "cublas 1": rate(lambda w, x=x: torch.nn.functional.linear(x[:1], w), weights)}
        for rows in (1, 2, 5, 16):
            cells[f"rows {rows}"] = rate(lambda w, r=rows, x=x: dense_rows(x[:r], w, None), weights)
        print(f"{name:26s} {n:6d}x{k:5d}  " + "  ".join(f"{c} {v:6.0f}" for c, v in cells.items()) + "  GB/s",
              flush=True)
        if args.sweep:
            sweep(name, weights, x)
        del weights


if __name__ == "__main__":
    main()
