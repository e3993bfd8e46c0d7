"""The benchmark suite (issue 7): moestream at real model sizes beside the peers and the physical limits,
in one run. Each stage fits one 10-minute call on the GPU machine:

  python -m benchmarks.suite stores     # real-geometry synthetic stores (30B; qwen3.8-flash-next layers to fit)
  python -m benchmarks.suite limits     # pinned H2D, O_DIRECT disk, HBM copy
  python -m benchmarks.suite moestream  # decode b=1, prefill 512/4096; pool 100/50/25%; host tier on/off
  python -m benchmarks.suite peers      # transformers on GPU; transformers + accelerate with offloaded experts
  python -m benchmarks.suite llamacpp --llama-bench BIN  # llama.cpp on a GGUF of the 30B geometry (llamacpp.py)
  python -m benchmarks.suite report     # table + plots from what the stages wrote

Stages append to `suite.json` in the results folder (`results/suite/`, or `$OUT/suite/` on the GPU machine);
`report` reads it back. Stores live under `--work` (default `$MOESTREAM_BENCH_DIR` or /tmp/moestream-bench), as
device.sh's do. On the GPU machine each call's $OUT starts empty: pass the previous call's file with `--state`, and
make the calls back to back (a machine idle for a while is given back, with the stores on its disk).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from benchmarks.common import BENCH_DIR, limits, machine, out_dir
from moestream.errors import MoestreamError
from moestream.experts.format import RecordLayout, precision_name
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams
from moestream.stats.counters import TIERS

MODELS = ("qwen3-30b", "qwen3.8-flash-next")  # each store is <work>/<model>
POOLS = (1.0, 0.5, 0.25)


def _state(path: str) -> dict:
    f = os.path.join(path, "suite.json")
    return json.load(open(f)) if os.path.isfile(f) else {"machine": machine(), "runs": []}


def _save(path: str, state: dict) -> None:
    with open(os.path.join(path, "suite.json"), "w") as f:
        json.dump(state, f, indent=1, default=str)


def stage_stores(args) -> None:
    from benchmarks.synthetic import build

    def existing(path: str):
        return open_store(path).manifest if os.path.isfile(os.path.join(path, "manifest.json")) else None

    stores = args.stores
    m = existing(stores["qwen3-30b"]) or build(stores["qwen3-30b"], "qwen3-30b", skew=args.skew)
    g = m.geometry
    # the 30B store's q3 and q2 variants are derived later (the low-bit rows): leave them room
    low_bit = sum(RecordLayout.build(p, g.hidden_size, g.intermediate_size).stride for p in ("q3", "q2"))
    disk = os.statvfs(args.work)
    free = disk.f_bavail * disk.f_frsize - g.num_records * low_bit - 8e9
    per_layer = 512 * RecordLayout.build("q4", 2560, 640).stride  # qwen3.8-flash-next records per layer
    layers = max(4, min(48, int(free // per_layer) // 4 * 4))
    # 1M rows an n-gram head (1.6 GB), not the model's 20M (32 GB): a token reads 16 rows whatever the size
    nxt = existing(stores["qwen3.8-flash-next"]) or build(stores["qwen3.8-flash-next"], "qwen3.8-flash-next",
                                                         layers=layers, skew=args.skew,
                                                         ngram_vocab_size_base=1_000_000)
    print(f"stores ready: qwen3-30b ({g.num_layers} layers), qwen3.8-flash-next ({nxt.geometry.num_layers} layers)")


def _bound(scenario: dict, lim: dict) -> float:
    """The physical bound on a scenario's rate: the larger of its streaming time (bytes from disk and host
    over their measured bandwidths), its HBM time (resident experts, and the dense weights once per forward)
    and its dense bf16 compute time."""
    # the disk's best measured rate: sequential blocks or record-sized random reads, whichever ran faster
    disk = max(lim[k] for k in ("disk_odirect_gbs", "disk_record_gbs", "disk_record_gbs_16_threads") if k in lim)
    tier_bw = {"disk": disk, "host": lim["h2d_pinned_gbs"]}
    moved = sum(scenario["bytes"][t] / (tier_bw[t] * 1e9) for t in ("disk", "host"))
    read = scenario["bytes"]["gpu"] + scenario["bytes"].get("dense", 0)
    hbm = read / (lim["hbm_copy_gbs"] / 2 * 1e9)  # reads only: half the copy figure
    compute = scenario["flops"] / (lim["bf16_matmul_tflops"] * 1e12)
    seconds = max(moved, hbm, compute)
    return scenario["work"] / seconds if seconds else float("inf")


def dense_bytes(store) -> int:
    """The bf16 dense weights one forward reads (the embedding is a lookup, not a read of the table)."""
    return os.path.getsize(store.dense_path) - 2 * store.model.vocab_size * store.model.hidden_size


def flops_per_token(store) -> float:
    """2 x the parameters a token touches: the dense weights plus top-k routed experts per MoE layer."""
    g = store.manifest.geometry
    experts = g.num_layers * store.model.num_experts_per_tok * 3 * g.hidden_size * g.intermediate_size
    return 2 * (dense_bytes(store) / 2 + experts)


SCENARIOS = (("decode", 16, 64), ("prefill", 512, 1), ("prefill", 4096, 1))
# issue 8's rows: low-bit experts where misses dominate (pool 25%, host tier on and off), on the 30B geometry,
# 32 decode tokens, as disk-only decode runs at a few tokens a second
LOW_BIT = (("moestream q4", {}), ("moestream q3", dict(experts=3)), ("moestream q2", dict(experts=2)),
           ("moestream q4, misses q2", dict(miss_experts=2)))  # q4 first: the same scenarios to compare with
LOW_BIT_SCENARIOS = (("decode", 16, 32), ("prefill", 4096, 1))
# the prefill ring's defaults (cross-layer lookahead, batches of 16) against the earlier ones, where they matter:
# 30B, pool 25%, host tier (v7, prefill 4096: 90% of bound; no lookahead, group 8: 55%)
RING = (("moestream, ring group 8", dict(ring_group=8)),
        ("moestream, no ring lookahead, group 8", dict(ring_lookahead=False, ring_group=8)))
RING_SCENARIOS = (("prefill", 512, 1), ("prefill", 4096, 1))
_FIRST_PROMPT: dict = {}  # paid once a process, not once a mode: a disk-only 512-token warm-up takes ~9 s


def _measure(llm, base: dict, per_token: float, dense: int, scenarios) -> list[dict]:
    """`base`: the run's model, engine, pool and host-tier fields; `dense`: dense weight bytes per forward."""
    rng = random.Random(0)
    # compile the kernels and capture the decode graph before timing (the first suite run timed them)
    llm.generate([[rng.randrange(llm.config.vocab_size) for _ in range(64)]], SamplingParams(max_tokens=4))
    if not _FIRST_PROMPT:  # a process's first prompt of 512+ tokens pays a one-time cost (v5: 0.7 s on 30B)
        first = llm.generate([[rng.randrange(llm.config.vocab_size) for _ in range(512)]], SamplingParams(max_tokens=1))
        _FIRST_PROMPT["first_prefill_s"] = 512 / first[0].stats["timings"]["prefill_tok_s"]
        base = base | _FIRST_PROMPT  # kept on the process's first mode's rows
    runs = []
    for kind, n, new in scenarios:
        ids = [rng.randrange(llm.config.vocab_size) for _ in range(n)]
        out = llm.generate([ids], SamplingParams(max_tokens=new, ignore_eos=True))[0]
        t, per_precision = out.stats["timings"], out.stats["experts"].values()
        decode = kind == "decode"
        work = new if decode else n
        run = {**base, "scenario": kind, "tokens": n, "rate": t["decode_tok_s" if decode else "prefill_tok_s"],
               "work": work, "flops": work * per_token,
               "bytes": {tier: sum(e["reads"][tier]["bytes"] for e in per_precision) for tier in TIERS}
               | {"dense": dense * (new if decode else 1)}}
        runs.append(run)
        print(json.dumps(run))
    return runs


def stage_moestream(args) -> list[dict]:
    from moestream.engine.llm import LLM

    runs = []
    for name, path in args.stores.items():
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            continue
        store = open_store(path)
        g, per_token, dense = store.manifest.geometry, flops_per_token(store), dense_bytes(store)
        modes = []
        if args.modes in ("all", "q4"):
            modes += [("moestream", {}, frac, host) for frac in args.pools
                      for host in (args.tiers if frac < 1 else [False])]
            if name == "qwen3-30b" and args.pools == list(POOLS):  # the ring's A/B belongs to the full suite
                modes += [(engine, opts, 0.25, True) for engine, opts in RING]
        if name == "qwen3-30b" and args.modes in ("all", "low-bit"):
            modes += [(engine, opts, 0.25, host) for engine, opts in LOW_BIT for host in (True, False)]
        for engine, opts, frac, host in modes:
            layout = RecordLayout.build(precision_name(opts.get("experts", 4)), g.hidden_size, g.intermediate_size)
            total_gb = g.num_records * layout.stride / 1e9
            llm = LLM(path, device=args.device, pool_gb=total_gb * frac * 1.0001,
                      host_gb=total_gb * 1.01 if host else 0, preload=frac == 1.0 or host, **opts)
            ring = llm.engine_config.expert
            base = {"model": name, "engine": engine, "pool": frac, "host_tier": host,
                    "ring_lookahead": ring.ring_lookahead, "ring_group": ring.ring_group}
            runs += _measure(llm, base, per_token, dense, SCENARIOS if engine == "moestream"
                             else RING_SCENARIOS if "ring" in engine else LOW_BIT_SCENARIOS)
            mode = f"{name}/{engine}, pool {frac:.0%}, {'host tier' if host else 'disk only'}"
            args.save(runs, {mode: hit_rates(llm.stats()["layers"])})  # a call stopped by its limit keeps these
            llm.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return runs


def hit_rates(layers: list[dict]) -> list[float]:
    """GPU pool hits over lookups per MoE layer, all precisions together."""
    out = []
    for per in layers:
        lookups = sum(c["lookups"] for c in per.values())
        out.append(sum(c["hits"] for c in per.values()) / lookups if lookups else 0.0)
    return out


def stage_peers(args) -> list[dict]:
    """transformers with the whole bf16 model on the GPU, and with the experts offloaded by accelerate, on each
    store."""
    from benchmarks.peers import run_peers

    stores = {name: path for name, path in args.stores.items() if os.path.isfile(os.path.join(path, "manifest.json"))}
    return run_peers(stores, offload_tokens=args.offload_tokens, on_rows=args.save)


def stage_llamacpp(args) -> list[dict]:
    """llama-bench all on the GPU and with the experts of 36 layers in RAM (as it loads them, and with --repack 0),
    on `<work>/qwen3-30b.gguf` (written first when missing: ~19 GB)."""
    from benchmarks import llamacpp

    if not args.llama_bench or not os.path.isfile(args.llama_bench):
        raise MoestreamError("the llamacpp stage needs --llama-bench BIN (benchmarks/llamacpp_build.sh builds it)")
    gguf = os.path.join(args.work, "qwen3-30b.gguf")
    if not os.path.isfile(gguf):
        llamacpp.write_gguf(gguf, tokenizer_json=args.tokenizer or llamacpp.TOKENIZER_JSON)
    runs = []
    for n_cpu_moe, extra in ((0, ()), (llamacpp.N_CPU_MOE, ()), (llamacpp.N_CPU_MOE, llamacpp.NO_REPACK)):
        # one run each: a call cut short keeps the first
        bench = llamacpp.bench(args.llama_bench, gguf, (n_cpu_moe,), reps=3, extra=extra)
        runs += llamacpp.suite_rows(bench["rows"], " " + " ".join(extra) if extra else "")
        args.save(runs)
    return runs


def stage_report(args) -> None:
    from benchmarks.report import write_report

    if not os.path.isfile(os.path.join(args.out, "suite.json")):
        raise MoestreamError(f"no suite.json in {args.out}: run the suite's stages first, or pass --out with one")
    write_report(args.out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["stores", "limits", "moestream", "peers", "llamacpp", "report"])
    p.add_argument("--skew", type=float, default=0.0, help="router skew for the stores (0 = even popularity)")
    p.add_argument("--offload-tokens", type=int, default=3)
    p.add_argument("--modes", choices=["all", "q4", "low-bit"], default="all",
                   help="moestream stage: which engine modes (deriving the low-bit stores takes minutes, once)")
    p.add_argument("--out", default=None, help="the results folder (default: results/suite, or $OUT/suite)")
    p.add_argument("--work", default=BENCH_DIR, help="where the stores are built and read (default: %(default)s)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--state", help="a suite.json from an earlier call to continue (each call's $OUT starts empty)")
    p.add_argument("--store", action="append", default=[], help="NAME=PATH: benchmark this store instead")
    p.add_argument("--llama-bench", help="llamacpp stage: the llama-bench binary")
    p.add_argument("--tokenizer", help="llamacpp stage: Qwen3's tokenizer.json (or .json.gz) for the GGUF")
    p.add_argument("--pools", default=",".join(map(str, POOLS)), help="moestream stage: pool fractions (%(default)s)")
    p.add_argument("--tiers", default="disk,host", help="moestream stage: below the pool, disk and/or host")
    args = p.parse_args()
    try:
        args.pools = [float(f) for f in args.pools.split(",")]
        args.tiers = [{"disk": False, "host": True}[t] for t in args.tiers.split(",")]
    except (ValueError, KeyError):
        p.error("--pools takes fractions (1.0,0.25) and --tiers disk and/or host (disk,host)")
    args.out = args.out or out_dir("suite")
    args.stores = dict(spec.split("=", 1) for spec in args.store) or {m: os.path.join(args.work, m) for m in MODELS}
    if args.stage == "report":  # reads what the stages wrote; needs no GPU and no stores
        stage_report(args)
        return
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    state = _state(os.path.dirname(args.state) if args.state else args.out)
    start = time.time()
    if args.stage == "stores":
        stage_stores(args)
    elif args.stage == "limits":
        store = args.stores.get("qwen3-30b", "")
        records = None
        if os.path.isfile(os.path.join(store, "manifest.json")):
            s = open_store(store)
            records = (s.experts_path("q4"), s.manifest.layouts["q4"].stride)
        state["limits"] = limits(records=records)
        print(state["limits"])
    elif args.stage in ("moestream", "peers", "llamacpp"):
        earlier = state["runs"]

        commit = machine()["commit"]

        def save(runs: list[dict], rates: dict | None = None) -> None:
            state.setdefault("hit_rates", {}).update(rates or {})
            lim = state.get("limits")
            for r in runs:
                r["bound"] = _bound(r, lim) if lim and r["engine"].startswith("moestream") else None
                r.setdefault("commit", commit)  # a state carried over calls may hold rows of several commits
            replaced = {(r.get("model"), r["engine"]) for r in runs}
            state["runs"] = [r for r in earlier if (r.get("model"), r["engine"]) not in replaced] + runs
            _save(args.out, state)

        args.save = save
        stage = {"moestream": stage_moestream, "peers": stage_peers, "llamacpp": stage_llamacpp}[args.stage]
        save(stage(args))
    # keyed by what the call ran, so that each call's time is kept for planning the next lease
    key = args.stage + (f" {args.modes} {','.join(args.stores)}" if args.stage == "moestream" else "")
    state.setdefault("stage_seconds", {})[key] = time.time() - start
    _save(args.out, state)


if __name__ == "__main__":
    try:
        main()
    except MoestreamError as e:
        sys.exit(f"error: {e}")
