"""The dense projections of a decode step at the flagship's shapes: the Triton GEMV at 1, 2, 5 and 16 token rows
and cuBLAS at 1, each over weight copies that together exceed the L2 (so HBM serves them), as GB/s of weights
read, timed as CUDA graph replays; and "L2 1": one row over one copy read again and again, which the L2 serves
where it fits (the ceiling of warming a step's next projections into L2 while the experts leave HBM idle).
Prints one line per shape.

python -m benchmarks.probes.gemv
"""

from __future__ import annotations

import torch
import triton.testing

from moestream.kernels.dense_gemv import dense_gemv

SHAPES = {  # (N, K): qwen4_exp's decode projections, and the 30B's attention
    "30B [q|k|v]": (5120, 2048),
    "30B o": (2048, 4096),
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


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(8, -(-200 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(16, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        cells = {"cublas 1": rate(lambda w, x=x: torch.nn.functional.linear(x[:1], w), weights)}
        for rows in (1, 2, 5, 16):
            cells[f"gemv {rows}"] = rate(lambda w, r=rows, x=x: dense_gemv(x[:r], w, None), weights)
        if n * k * 2 < 40 * 2**20:
            cells["L2 1"] = rate(lambda w, x=x: dense_gemv(x[:1], w, None), weights[:1] * len(weights))
        print(f"{name:26s} {n:6d}x{k:5d}  " + "  ".join(f"{c} {v:6.0f}" for c, v in cells.items()) + "  GB/s",
              flush=True)
        del weights


if __name__ == "__main__":
    main()
