"""Experts spread over several GPUs (issue 33): decode and prefill 4096 on 1 GPU and on N, each GPU with the same
pool (a fraction of the whole model's records) and a host tier of its own, from one process per GPU
(engine/ranks.py). Rows as the suite's (`benchmarks/suite.py` `_measure`), with `gpus` set.

  python -m benchmarks.gpus STORE OUT.json [--gpus 1,2] [--pool-frac 0.25] [--no-host]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import machine
from benchmarks.suite import _measure, dense_bytes, flops_per_token
from moestream.engine.llm import LLM
from moestream.experts.store import open_store

SCENARIOS = (("decode", 16, 64), ("prefill", 4096, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--pool-frac", type=float, default=0.25, help="each GPU's pool, of the whole model's records")
    p.add_argument("--no-host", action="store_true")
    args = p.parse_args()
    store = open_store(args.store)
    g, layout = store.manifest.geometry, store.manifest.layouts[store.default_precision]
    total_gb = g.num_records * layout.stride / 1e9
    rows = []
    for gpus in (int(n) for n in args.gpus.split(",")):
        host = 0 if args.no_host else total_gb / gpus * 1.01  # each GPU's tier holds its share
        llm = LLM(args.store, gpus=gpus, pool_gb=total_gb * args.pool_frac * 1.0001, host_gb=host, preload=True)
        base = {"gpus": gpus, "pool": args.pool_frac, "host_tier": not args.no_host}
        rows += _measure(llm, base, flops_per_token(store), dense_bytes(store), SCENARIOS)
        llm.close()
        torch.cuda.empty_cache()
    one = {r["scenario"]: r["rate"] for r in rows if r["gpus"] == 1}
    for r in rows:
        r["vs_one_gpu"] = r["rate"] / one[r["scenario"]] if r["scenario"] in one else None
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "store": args.store, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['gpus']} GPU(s) {r['scenario']:8s} {r['rate']:9.1f} tok/s  x{r['vs_one_gpu'] or 0:.2f}")


if __name__ == "__main__":
    main()
