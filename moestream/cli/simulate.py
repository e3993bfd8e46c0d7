"""moestream simulate TRACE [--pools F,...] [--slots N,...] [--json]: replay a routing trace (`generate
--trace-routing`) through LRU, LFU, the engine's own policy and Belady's optimum (MIN) at several pool sizes, and
show how often each layer's token t+1 reuses token t's experts (stats/cache_sim.py, experts/replay.py)."""

from __future__ import annotations

import argparse
import json
import math

from moestream.errors import MoestreamError


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
        if not values or any(not math.isfinite(v) or v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
        return values
    return parse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a routing trace written by `moestream generate --trace-routing FILE`")
    p.add_argument("--pools", type=_numbers(float), default=[0.1, 0.25, 0.5, 0.75, 1.0],
                   help="pool sizes as fractions of all expert records (default 0.1,0.25,0.5,0.75,1.0)")
    p.add_argument("--slots", type=_numbers(int), help="pool sizes in records (instead of --pools)")
    p.add_argument("--lookahead", action="store_true",
                   help="add `engine+ahead`: the engine with decode lookahead that always guesses right")
    p.add_argument("--preload", action="store_true", help="a pool of every record starts full (as on CUDA)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from moestream.experts.replay import simulate
    from moestream.stats import trace

    try:
        t = trace.load(args.trace)
    except ValueError as e:
        raise MoestreamError(str(e)) from None
    slots = args.slots or [min(t.records, round(f * t.records)) for f in args.pools]
    out = simulate(t, slots, args.lookahead, args.preload)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['lookups']} lookups over {t.layers} layers x {t.experts} experts ({out['records']} records, "
          f"{out['compulsory']} used); hit rate by pool size")
    print(f"{'policy':<13}" + "".join(f"{f'{n} ({n / t.records:.0%})':>14}" for n in slots))
    for name, rates in out["hit_rate"].items():
        print(f"{name:<13}" + "".join(f"{r:>14.1%}" for r in rates))
    print(f"reuse: fraction of token t+1's experts token t used (uniform routing: {out['reuse_if_uniform']:.1%})")
    for layer, r in enumerate(out["reuse"]):
        print(f"  layer {layer:>3}  " + ("-" if r is None else f"{r:.1%}"))
    return 0
