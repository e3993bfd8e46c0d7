"""End to end on a real-geometry synthetic store: decode tok/s (graph vs eager), prefill tok/s and the
prefill copy/compute overlap per layer with a pool below the model; with --trace, each prefill's timeline and
what it says about overlap (copies busy, kernels busy, both at once, GPU idle).

python -m benchmarks.probes.e2e STORE [--decode] [--prefill] [--fracs 0.25,1.0] [--trace]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import time

import torch

from benchmarks.common import out_dir, write
from moestream.config import ExpertConfig
from moestream.engine.llm import LLM
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def kernel_us(llm: LLM, ids: list[int], tokens: int) -> dict[str, float]:
    """CUDA microseconds by kernel name (graph replays' kernels too) for one generate of `tokens` tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
    return {e.key: e.device_time_total for e in prof.key_averages()}


def _top(us: dict[str, float], unit: str) -> list[tuple[str, float]]:
    rows = sorted(us.items(), key=lambda r: -r[1])[:30]
    print(f"  {sum(us.values()):9.1f} {unit} in {len(us)} kernels, the top {len(rows)}:")
    for name, t in rows:
        print(f"  {t:9.1f} {unit}  {name[:100]}")
    return rows


def profile_decode(llm: LLM, ids: list[int], steps: int = 32) -> list[tuple[str, float]]:
    """Top kernels per decode step: a generate of 1 + steps tokens less one of 1 token, so the prompt's
    prefill cancels."""
    prefill, total = kernel_us(llm, ids, 1), kernel_us(llm, ids, 1 + steps)
    return _top({k: (us - prefill.get(k, 0.0)) / steps for k, us in total.items()}, "us/step")


def profile_prefill(llm: LLM, n: int = 4096) -> list[tuple[str, float]]:
    return _top(kernel_us(llm, prompt(n, llm.config.vocab_size, seed=n), 1), f"us/prefill of {n}")


def decode_runs(store: str, tokens: int = 64, profile: bool = False,
                modes: tuple[str, ...] = ("graph", "eager", "handshake")) -> list[dict]:
    rows = []
    for mode in modes:
        llm = LLM(store, device="cuda", decode_mode=mode)
        ids = prompt(16, llm.config.vocab_size)
        llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))  # warm: compile, capture
        out = llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
        t = out.stats["timings"]
        rows.append({"mode": mode, "decode_tok_s": t["decode_tok_s"], "ms_per_token": 1e3 / t["decode_tok_s"],
                     "graph_replays": llm.decoder.graph_replays, "tokens": out.token_ids[:8]})
        print(rows[-1])
        if profile and mode in ("graph", "eager"):
            rows[-1]["profile_us_per_step"] = profile_decode(llm, ids)
        if profile and mode == "graph":
            rows[-1]["profile_prefill_us"] = profile_prefill(llm)
        llm.close()
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def traced(path: str | None):
    """A host + GPU timeline (Chrome trace, gzipped) of the block, to see where the host or a stream waits."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _spans(path: str) -> list[dict]:
    """A gzipped Chrome trace's events that have a duration."""
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if "dur" in e]


def summarize(path: str) -> dict:
    """Seconds, from a gzipped Chrome trace: `copy` (host-to-device copies busy), `compute` (kernels busy),
    `both` (at once), `wall` (first GPU event to last), `idle` (neither)."""
    events = _spans(path)
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copy, compute = _union(copies), _union(kernels)
    busy = _union(copy + compute)
    if not busy:
        return {}
    wall, us = busy[-1][1] - busy[0][0], 1e-6
    return {"copy_s": _length(copy) * us, "compute_s": _length(compute) * us,
            "both_s": _intersection(copy, compute) * us, "wall_s": wall * us, "idle_s": (wall - _length(busy)) * us}


def gaps(path: str, top: int = 8) -> dict:
    """Where a traced block's GPU waits (microseconds, from its gzipped Chrome trace): `lead` (the block's first host
    event to its first kernel), `busy` and `idle` between its first kernel and its last, `tail` (the last kernel's
    end to the block's last host event), and the `top` longest idle gaps, each with the kernels around it and how
    long before its end the host launched the next (near 0: the GPU waited for the host's launch)."""
    events = _spans(path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    calls = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", *calls)]
    launched = {e["args"].get("correlation"): e["ts"] for e in events if e.get("cat") in calls}
    if not kernels or not host:
        return {}
    spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    holes, end, previous = [], spans[0][0], kernels[0]
    for k in kernels:
        if k["ts"] > end:
            holes.append({"us": round(k["ts"] - end, 1), "before": previous["name"][:60], "after": k["name"][:60],
                          "launch_lead_us": round(k["ts"] - launched.get(k["args"].get("correlation"), k["ts"]), 1)})
        end, previous = max(end, k["ts"] + k["dur"]), k
    start, stop = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    return {"lead_us": round(spans[0][0] - start, 1), "busy_us": round(_length(spans), 1),
            "idle_us": round(spans[-1][1] - spans[0][0] - _length(spans), 1), "tail_us": round(stop - spans[-1][1], 1),
            "gaps": len(holes), "top": sorted(holes, key=lambda h: -h["us"])[:top]}


def prefill_runs(store: str, fracs: list[float], lengths: list[int], host_gb: float = 0.0,
                 warm: bool = False, trace: str | None = None, ring_group: int = ExpertConfig.ring_group,
                 ring_lookahead: bool = ExpertConfig.ring_lookahead, profile: bool = True) -> list[dict]:
    """With `warm`, each prompt runs once first so the host tier holds what the measured run misses; with
    `trace` (a folder), the measured run's timeline is saved there and summarized in the row. Without `profile`,
    no per-layer timings: a resident layer then groups its entries on the device, as in use."""
    s = open_store(store)
    total_gb = s.manifest.geometry.num_records * s.manifest.layouts["q4"].stride / 1e9
    rows = []
    for frac in fracs:
        llm = LLM(store, device="cuda", pool_gb=total_gb * frac, host_gb=host_gb, profile=profile, preload=False,
                  ring_group=ring_group, ring_lookahead=ring_lookahead)
        for n in lengths:
            ids = prompt(n, llm.config.vocab_size, seed=n)
            if warm:
                llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            name = f"prefill-{frac:g}-{n}-g{ring_group}{'-early' if ring_lookahead else ''}"
            trace_path = trace and os.path.join(trace, f"{name}.json")
            with traced(trace_path):
                out = llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
            wall = time.perf_counter() - start
            e = out.stats["experts"]["q4"]
            timings = llm.stats()["prefill_timings"][-s.manifest.geometry.num_layers:]
            copy = sum(t["copy_s"] for t in timings)
            compute = sum(t["compute_s"] for t in timings)
            gpu_wall = sum(t["wall_s"] for t in timings)
            host = sum(t["host_s"] for t in timings)
            reads = {tier: e["reads"][tier]["bytes"] / 1e9 for tier in ("disk", "host")}
            # the engine's prefill time (what the suite reports), and generate()'s wall around it
            rows.append({"pool_frac": frac, "host_gb": host_gb, "ring_group": ring_group,
                         "ring_lookahead": ring_lookahead, "prompt": n,
                         "prefill_tok_s": out.stats["timings"]["prefill_tok_s"], "generate_seconds": wall,
                         "disk_gb": reads["disk"], "host_read_gb": reads["host"],
                         "copy_s": copy, "compute_s": compute, "expert_wall_s": gpu_wall, "host_s": host,
                         "io_wait_s": e["io_wait_seconds"], "ring_wait_s": e["ring_wait_seconds"],
                         "timeline": summarize(trace_path + ".gz") if trace_path else None, "per_layer": timings})
            print({k: v for k, v in rows[-1].items() if k != "per_layer"})
        llm.close()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--decode", action="store_true")
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--fracs", default="0.25,1.0")
    p.add_argument("--lengths", default="512,4096")
    p.add_argument("--host-gb", type=float, default=0.0)
    p.add_argument("--warm", action="store_true", help="run each prompt once before timing it")
    p.add_argument("--decode-modes", default="graph,eager,handshake")
    p.add_argument("--profile", action="store_true",
                   help="break graphed and eager decode steps, and a graphed run's prefill of 4096, down by kernel")
    p.add_argument("--trace", action="store_true", help="save each measured prefill's host + GPU timeline")
    p.add_argument("--no-profile", action="store_true",
                   help="prefill: no per-layer timings (which need the host's grouping of a resident layer)")
    p.add_argument("--ring-groups", default=str(ExpertConfig.ring_group),
                   help="prefill: experts per ring batch, one run each (e.g. 8,16)")
    p.add_argument("--ring-lookahead", default="on" if ExpertConfig.ring_lookahead else "off",
                   help="prefill: the next layer's ring fetched early: off, on, or off,on (one run each)")
    args = p.parse_args()
    data, table = {}, []
    if args.decode:
        data["decode"] = decode_runs(args.store, profile=args.profile, modes=tuple(args.decode_modes.split(",")))
        table += [["decode", r["mode"], f"{r['decode_tok_s']:.1f} tok/s", f"{r['ms_per_token']:.2f} ms/token", ""]
                  for r in data["decode"]]
    if args.prefill:
        data["prefill"] = [r for early in args.ring_lookahead.split(",") for group in args.ring_groups.split(",")
                           for r in prefill_runs(args.store, [float(f) for f in args.fracs.split(",")],
                                                 [int(n) for n in args.lengths.split(",")], args.host_gb, args.warm,
                                                 out_dir("e2e") if args.trace else None, int(group), early == "on",
                                                 not args.no_profile)]
        table += [["prefill", f"pool {r['pool_frac']:.0%}, {r['prompt']} tokens, group {r['ring_group']}"
                   f"{', early ring' if r['ring_lookahead'] else ''}",
                   f"{r['prefill_tok_s']:.0f} tok/s",
                   f"copy {r['copy_s']:.2f} s, compute {r['compute_s']:.2f} s, wall {r['expert_wall_s']:.2f} s, "
                   f"host {r['host_s']:.2f} s",
                   f"disk {r['disk_gb']:.1f} GB, host {r['host_read_gb']:.1f} GB"] for r in data["prefill"]]
    write(out_dir("e2e"), "e2e", data, table, ["phase", "case", "rate", "detail", "bytes"])


if __name__ == "__main__":
    main()
