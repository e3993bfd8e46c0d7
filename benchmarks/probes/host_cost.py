"""The host's work in one prefill layer's expert path, timed on the CPU (no GPU, no kernels): the grouping, the
provider's decisions (ring path) and the tile tables. On the H200 the GPU waits for this after the routing's
counts reach the host (docs/performance.md: 1.45 ms a layer of idle GPU at 4096 tokens, every expert resident).
With `--pool` below 1 the ring streams the rest from a host tier holding every record, copies skipped
(`fake_reads`): the decisions and fetch bookkeeping, without the copies' own enqueue cost.

python -m benchmarks.probes.host_cost [--store DIR] [--rows 4096] [--pool 0.25]   (builds a 2-layer 30B store if none)
"""

from __future__ import annotations

import argparse
import itertools
import os
import timeit

import torch

from benchmarks.common import BENCH_DIR
from moestream.config import ExpertConfig
from moestream.experts.grouping import group_by_expert
from moestream.experts.provider import ExpertProvider, ExpertStep
from moestream.experts.store import open_store
from moestream.kernels import expert_mlp


def _us(fn, calls: int = 200) -> float:
    fn()
    return timeit.timeit(fn, number=calls) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", default=os.path.join(BENCH_DIR, "host-cost-store"))
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--pool", type=float, default=1.0, help="the pool's share of the records")
    args = p.parse_args()
    if not os.path.isdir(args.store):
        from benchmarks.synthetic import build

        build(args.store, "qwen3-30b", layers=2)
    store = open_store(args.store)
    g = store.manifest.geometry
    gb = g.num_records * store.manifest.layouts["q4"].stride / 1e9
    experts = ExpertConfig(pool_gb=1.2 * gb, direct_io=False) if args.pool >= 1 else \
        ExpertConfig(pool_gb=args.pool * gb, host_gb=1.1 * gb, direct_io=False, fake_reads=True)
    provider = ExpertProvider(store, experts, torch.device("cpu"), 8)
    ids = torch.rand(args.rows, g.num_experts, generator=torch.Generator().manual_seed(0)).argsort(dim=1)[:, :8]
    x = torch.zeros(args.rows, 8)
    for layer in (*range(g.num_layers), 0, 1):  # fills the pool (and the host tier): later steps are steady
        list(provider.parts(layer % g.num_layers, ids, x, ExpertStep()))
    cfg = expert_mlp.tile_config("prefill", provider.layout)
    batches = list(provider.parts(0, ids, x, ExpertStep()))
    grouping = _us(lambda: group_by_expert(ids, g.num_experts))
    step = group_by_expert(ids, g.num_experts)

    layers = itertools.cycle(range(g.num_layers))  # in turn: a streamed layer's fills evict the other's

    def decide():  # `batches` less its grouping
        provider.pool.new_step()
        list(provider.ring.batches(next(layers), step, None))
    decisions = _us(decide)
    tiles = _us(lambda: [expert_mlp.prefill_tiles(b.spans, [b.buffer.data_ptr() + s * b.buffer.stride(0)
                                                            for s in b.slots], cfg) for b in batches])
    print(f"{args.rows} rows, {len(batches)} batch(es) of {[len(b.slots) for b in batches]} experts, us a layer: "
          f"grouping {grouping:.0f} (its argsort runs on the GPU there), provider {decisions:.0f}, "
          f"tile tables {tiles:.0f}")
    provider.close()


if __name__ == "__main__":
    main()
