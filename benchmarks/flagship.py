"""Qwen3.8-Flash-Next at its real size (issue 26): the whole model's geometry under the GPU budgets of the cards
its users have, beside the peers' published figures. Each stage fits one 10-minute call on the GPU machine:

  python -m benchmarks.flagship store --work W   # W/flash-next-full: 48 layers + the MTP layer's experts
  python -m benchmarks.flagship run --work W [--rows resident,32gb-host,...]
  python -m benchmarks.flagship report            # the table from what `run` wrote (results/flagship)

The H200 machine has a 64 GB disk and 128 GB of RAM, and Q4 records of the whole model take 69.4 GB: its Q4 file
is sparse (holes: zero experts, read over PCIe and computed like any others; disk reads of holes would be
fiction, so no row reads Q4 from disk), its Q2 file holds real random codes on disk (38.6 GB) and serves the
disk-only row and the Q2 misses. The n-gram table has 16 heads of `--ngram-rows` rows (1M: 1.6 GB; the model's
20M would not fit beside the Q2 file; a token reads 16 rows whatever the size), in pinned host memory.
Routing is the random routers' near-uniform one (the worst case for a cache), or with `--routing TRACE` (both
stages) a store of its own whose routers follow a recorded trace's popularity per layer (not its reuse). Each row
is one user's engine (max_batch 1, as the peers' batch-1 figures): the default's 16 batch slots would take their
states and KV (2.4 GB at 24 GB) from the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks.common import BENCH_DIR, limits, machine, out_dir
from benchmarks.suite import _bound, _measure, dense_bytes, flops_per_token, hit_rates
from moestream.errors import MoestreamError
from moestream.experts.store import open_store

STORE = "flash-next-full"
GiB = 2**30
# name -> (engine options, what it stands for); budgets are the cards' memory in GiB, all of it (weights, KV,
# activations, ring and pool counted), which is generous by the driver's own reservation (~0.5 GiB)
ROWS = {
    "resident": (dict(), "every expert resident (H200)"),
    "32gb-host": (dict(gpu_gb=32 * GiB / 1e9, host=True), "32 GB card (RTX 5090) + host tier, Q4"),
    "32gb-host-q2-misses": (dict(gpu_gb=32 * GiB / 1e9, host=True, miss_experts=2),
                            "32 GB card + host tier, Q4, misses Q2"),
    "24gb-host": (dict(gpu_gb=24 * GiB / 1e9, host=True), "24 GB card (RTX 4090/3090) + host tier, Q4"),
    "24gb-host-q2-misses": (dict(gpu_gb=24 * GiB / 1e9, host=True, miss_experts=2),
                            "24 GB card + host tier, Q4, misses Q2"),
    "24gb-disk-q2": (dict(gpu_gb=24 * GiB / 1e9, experts=2), "24 GB card, disk only, Q2"),
}
SCENARIOS = (("decode", 16, 64), ("prefill", 4096, 1))
PEERS = [  # published, batch 1, this model (docs: issue 26)
    ("SGLang NVFP4, RTX PRO 6000, n-gram table in pinned RAM", 87.0, None),
    ("FreeToken, experts in pinned RAM + VRAM cache, RTX 5090 (32 GB)", 65.0, None),
    ("FreeToken, RTX 4090 (24 GB)", 36.0, None),
    ("llama.cpp -cmoe, RTX 3090 (24 GB)", 23.9, 34.5),
    ("ExLlamaV3 CPU-MoE", 17.3, None),
    ("Cherenkov, 32 GB M4 Air", 8.5, 122.0),
]


def store_path(args) -> str:
    """The uniform store, or with --routing TRACE its own store whose routers follow the trace."""
    name = os.path.basename(args.routing).split(".")[0] if args.routing else None
    return os.path.join(args.work, f"{STORE}-{name}" if name else STORE)


def stage_store(args) -> None:
    from benchmarks.synthetic import build

    path = store_path(args)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        print(f"{path} exists")
        return
    m = build(path, "qwen3.8-flash-next", layers=48, ngram_vocab_size_base=args.ngram_rows,
              precisions=tuple(args.precisions.split(",")), sparse=("q4",), mtp=True, routing=args.routing)
    print(f"wrote {path}: {m.geometry.num_layers} record layers, files "
          + ", ".join(f"{n} {f.size / 1e9:.1f} GB" for n, f in m.files.items()))


def stage_run(args, state: dict) -> None:
    from moestream.engine.llm import LLM

    path = store_path(args)
    store = open_store(path)
    routing = store.manifest.source.get("routing", "uniform")
    q2 = store.manifest.layouts.get("q2")  # real data on disk: its random reads are the disk rows' bound
    if "limits" not in state:
        state["limits"] = limits(records=(store.experts_path("q2"), q2.stride) if q2 else None)
    per_token, dense = flops_per_token(store), dense_bytes(store)
    q4_total = store.manifest.geometry.num_records * store.manifest.layouts["q4"].stride / 1e9
    for name in args.rows.split(","):
        options, meaning = ROWS[name]
        options = dict(options)
        host = options.pop("host", False)
        try:
            llm = LLM(path, device=args.device, host_gb=1.01 * q4_total if host else 0, preload=True, max_batch=1,
                      **options)
        except MoestreamError as e:  # a budget the load cannot meet is a finding, not the end of the stage
            state.setdefault("refused", {})[name] = str(e)
            print(f"{name}: {e}")
            continue
        try:
            state.get("refused", {}).pop(name, None)
            base = {"model": STORE, "engine": "moestream", "row": name, "commit": state["machine"]["commit"],
                    "meaning": meaning, "routing": routing, "pool": 0.0, "host_tier": host,
                    "memory": llm.stats()["memory"]}
            runs = _measure(llm, base, per_token, dense, [s for s in SCENARIOS if s[0] in args.scenarios.split(",")])
            stats = llm.stats()
            used = [per for per in stats["layers"] if any(c["lookups"] for c in per.values())]  # not the MTP layer
            rates = hit_rates(used)
            for r in runs:
                r["bound"] = _bound(r, state["limits"])
                r["hit_rate_mean"] = sum(rates) / len(rates)
                r["hit_rate_min"] = min(rates)
                r["ngram"] = stats["ngram"]
            state["runs"] = [r for r in state.get("runs", []) if (r.get("row"), r.get("routing", "uniform"))
                             != (name, routing)] + runs
            state.setdefault("hit_rates", {})[name if routing == "uniform" else f"{name} ({routing})"] = rates
            _save(args.out, state)
        finally:
            llm.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def report(state: dict) -> list[str]:
    lines = ["| row | routing | scenario | tok/s | bound | of bound | hit rate (mean, min) "
             "| MB a token: gpu / host / disk |", "|---|---|---|---|---|---|---|---|"]
    for r in state.get("runs", []):
        per = {t: r["bytes"][t] / r["work"] / 1e6 for t in ("gpu", "host", "disk")}
        lines.append(f"| {r['meaning']} | {r.get('routing', 'uniform')} "
                     f"| {r['scenario']} {r['tokens']} | {r['rate']:,.1f} | {r['bound']:,.1f} | "
                     f"{r['rate'] / r['bound']:.0%} | {r['hit_rate_mean']:.0%}, {r['hit_rate_min']:.0%} | "
                     + " / ".join(f"{v:,.0f}" for v in per.values()) + " |")
    lines += ["", "| peer (published) | decode tok/s | prefill tok/s |", "|---|---|---|"]
    lines += [f"| {name} | {d} | {'-' if p is None else p} |" for name, d, p in PEERS]
    return lines


def _save(out: str, state: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "flagship.json"), "w") as f:
        json.dump(state, f, indent=1, default=str)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(report(state)) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["store", "run", "report"])
    p.add_argument("--work", default=BENCH_DIR)
    p.add_argument("--out", default=None, help="results folder (default: results/flagship, or $OUT/flagship)")
    p.add_argument("--state", help="a flagship.json from an earlier call to continue")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--scenarios", default="decode,prefill", help="run: which of decode 64 / prefill 4096")
    p.add_argument("--ngram-rows", type=int, default=1_000_000, help="rows per n-gram head")
    p.add_argument("--device", default="cuda")
    p.add_argument("--routing", help="a routing trace (from generate --trace-routing): its own store, "
                                     "routers following the trace's popularity per layer")
    p.add_argument("--precisions", default="q4,q2",
                   help="store: the record files (the Q2 file takes ~4 minutes to write there; rows that need it "
                        "are refused without it)")
    args = p.parse_args()
    args.out = args.out or out_dir("flagship")
    if args.stage == "store":
        os.makedirs(args.work, exist_ok=True)
        stage_store(args)
        return
    saved = args.state or os.path.join(args.out, "flagship.json")  # rows add to what the folder holds
    state = json.load(open(saved)) if os.path.isfile(saved) else {"machine": machine(), "runs": []}
    if args.stage == "run":
        state["machine"] = machine()  # each row keeps the commit it was measured at
        stage_run(args, state)
    _save(args.out, state)
    print("\n".join(report(state)))


if __name__ == "__main__":
    try:
        main()
    except MoestreamError as e:
        sys.exit(f"error: {e}")
