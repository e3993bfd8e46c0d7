"""Batched decode in the engine: N sequences decoding together, resident and with a partial pool + host tier,
timed from the step when all N decode together. Per N: aggregate decode tok/s, the step's ms, and against one
stream; offloaded, the union of experts a step looks up, the host-tier bytes it reads in place, and the bound
those bytes set over PCIe (the pinned host-to-device rate measured in the same run).

  python -m benchmarks.batching STORE OUT.json [--pool-frac 0.25 --host] [--streams 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from benchmarks.common import h2d_gbs, machine, tier_gb
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams

PROMPT, NEW = 64, 64


def _sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def _decode(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    """Submit every prompt, step until all decode together, then time the steps to the end: their tokens, seconds
    and steps, and what the expert counters moved by over them (all precisions)."""
    requests = [llm._submit(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
    while len(llm.scheduler.running) < len(prompts):
        if not llm.scheduler.busy or any(r.finished for r in requests):
            raise RuntimeError(f"{len(prompts)} sequences never decoded together: some ended first")
        llm.step()
    made, steps, before = sum(len(r.steps) for r in requests), sum(llm.scheduler.batch_rows.values()), \
        llm.provider.totals()
    _sync(llm)
    tic = time.perf_counter()
    while llm.scheduler.busy:
        llm.step()
    out = {"seconds": time.perf_counter() - tic, "tokens": sum(len(r.steps) for r in requests) - made,
           "steps": sum(llm.scheduler.batch_rows.values()) - steps}
    after = llm.provider.totals()
    out |= {k: sum(after[p][k] - before.get(p, {}).get(k, 0) for p in after) for k in ("lookups", "misses")}
    out["host_bytes"] = sum(after[p]["reads"]["host"]["bytes"] - (before[p]["reads"]["host"]["bytes"]
                                                                  if p in before else 0) for p in after)
    return out


def measure(llm: LLM, streams: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(PROMPT)] for _ in range(streams)]
    _decode(llm, prompts, 4)  # this batch size's graph captured
    run = _decode(llm, prompts, NEW)
    steps, layers = run["steps"], llm.provider.geometry.num_layers
    return {"streams": streams, "decode_tok_s": run["tokens"] / run["seconds"], "step_ms": 1e3 * run["seconds"] / steps,
            "union_per_layer": run["lookups"] / steps / layers, "misses_per_layer": run["misses"] / steps / layers,
            "host_bytes_per_step": run["host_bytes"] / steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--pool-frac", type=float, default=1.0)
    p.add_argument("--host", action="store_true", help="the rest of the experts in the pinned host tier")
    p.add_argument("--streams", default="1,2,4,8,16")
    args = p.parse_args()
    pool_gb, host_gb = tier_gb(args.store, args.pool_frac, args.host)
    llm = LLM(args.store, pool_gb=pool_gb, host_gb=host_gb)
    rows = [measure(llm, int(n)) for n in args.streams.split(",")]
    one = rows[0]["decode_tok_s"]
    pcie = h2d_gbs() * 1e9 if torch.cuda.is_available() else float("nan")
    for row in rows:
        row["vs_one_stream"] = row["decode_tok_s"] / one
        if row["host_bytes_per_step"]:
            row["pcie_bound_tok_s"] = row["streams"] * pcie / row["host_bytes_per_step"]
            row["of_pcie_bound"] = row["decode_tok_s"] / row["pcie_bound_tok_s"]
        print(json.dumps(row))
    result = {"machine": machine(), "store": args.store, "pool_frac": args.pool_frac, "host_tier": args.host,
              "h2d_pinned_gbs": pcie / 1e9, "prompt": PROMPT, "new_tokens": NEW, "rows": rows,
              "memory": llm.stats()["memory"]}
    llm.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
