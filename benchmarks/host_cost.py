"""The host's work in one prefill layer's expert path, timed on the CPU (no GPU, no kernels): the grouping, the
provider's decisions (ring path, every expert resident) and the tile tables. On the H200 the GPU waits for this
after the routing's counts reach the host (NOTES, session 18: 1.45 ms a layer of idle GPU at 4096 tokens).

python -m benchmarks.host_cost [--store DIR] [--rows 4096]   (builds a 2-layer 30B-geometry store if none)
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from moestream.config import ExpertConfig
from moestream.experts.grouping import group_by_expert
from moestream.experts.provider import StreamingProvider
from moestream.experts.store import open_store
from moestream.kernels import expert_mlp


def _us(fn, calls: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", default="/tmp/host-cost-store")
    p.add_argument("--rows", type=int, default=4096)
    args = p.parse_args()
    if not os.path.isdir(args.store):
        from benchmarks.synthetic import build

        build(args.store, "qwen3-30b", layers=2)
    store = open_store(args.store)
    g = store.manifest.geometry
    provider = StreamingProvider(store, ExpertConfig(pool_gb=1.2 * g.num_records * store.manifest.layouts["q4"].stride
                                                     / 1e9, direct_io=False), torch.device("cpu"), 8)
    ids = torch.rand(args.rows, g.num_experts, generator=torch.Generator().manual_seed(0)).argsort(dim=1)[:, :8]
    x = torch.zeros(args.rows, 8)
    for layer in range(g.num_layers):  # fills the pool: every later step finds its experts resident
        list(provider.batches(layer, ids, x))
    cfg = expert_mlp.tile_config("prefill", provider.layout)
    batches = list(provider.batches(0, ids, x))
    grouping = _us(lambda: group_by_expert(ids, g.num_experts))
    step = group_by_expert(ids, g.num_experts)

    def decide():  # `batches` less its grouping
        provider.pool.new_step()
        list(provider._ring_path(0, step, {}))
    decisions = _us(decide)
    tiles = _us(lambda: [expert_mlp.prefill_tiles(b.spans, [b.buffer.data_ptr() + s * b.buffer.stride(0)
                                                            for s in b.slots], cfg) for b in batches])
    print(f"{args.rows} rows, {len(batches)} batch(es) of {[len(b.slots) for b in batches]} experts, us a layer: "
          f"grouping {grouping:.0f} (its argsort runs on the GPU there), provider {decisions:.0f}, "
          f"tile tables {tiles:.0f}")
    provider.close()


if __name__ == "__main__":
    main()
