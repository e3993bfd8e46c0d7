"""A graphed decode step's kernels and the gaps between them: a CUPTI trace of a few resident decode steps, each
kernel by name with its launches a step, mean duration and the idle time after it (docs/performance.md, the
resident decode step kernel by kernel), and a step's wall time against its kernels' busy time (what the host's turn
between steps costs). Graph replays are traced kernel by kernel.

python -m benchmarks.probes.step_kernels STORE [--steps 16] [--streams N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def kernels_of(trace: str) -> list[dict]:
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])


def table(kernels: list[dict], steps: int) -> list[dict]:
    """Per kernel name: launches a step, mean us, us idle before the next kernel (gaps over 100 us are the host's
    turn between steps and are left out)."""
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for a, b in zip(kernels, kernels[1:] + [None]):
        row = by[a["name"][:80]]
        row[0] += 1
        row[1] += a["dur"]
        gap = 0.0 if b is None else b["ts"] - a["ts"] - a["dur"]
        row[2] += gap if 0 < gap < 100 else 0.0
    return sorted(({"kernel": name, "a_step": n / steps, "us": dur / n, "gap_after_us": gap / n}
                   for name, (n, dur, gap) in by.items()), key=lambda r: -r["a_step"] * (r["us"] + r["gap_after_us"]))


def covered(kernels: list[dict]) -> tuple[float, float]:
    """The union of the kernels' intervals (overlapping streams counted once), and the sum of the idle gaps longer
    than 20 us (the host's turn between steps), in us."""
    busy = turns = 0.0
    end = None
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        if end is not None and start > end:
            turns += start - end if start - end > 20 else 0.0
        busy += max(0.0, stop - max(start, end if end is not None else start))
        end = stop if end is None else max(end, stop)
    return busy, turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--streams", type=int, default=1, help="sequences decoding together in the traced steps")
    args = p.parse_args()
    llm = LLM(args.store)
    llm.generate([[1, 2, 3, 4] * 4], SamplingParams(max_tokens=4, ignore_eos=True))  # compile and capture
    for s in range(args.streams):
        llm._submit([5 + s, 6, 7, 8] * 4, SamplingParams(max_tokens=2 * args.steps + 8, ignore_eos=True))
    llm.step()
    while len(llm.scheduler.running) < args.streams:  # the prompts, then a first decode step, outside the trace
        llm.step()
    llm.step()
    torch.cuda.synchronize()
    tic = time.perf_counter()  # untraced: tracing slows a replay
    for _ in range(args.steps):
        llm.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - tic) / args.steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            llm.step()
        torch.cuda.synchronize()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    kernels = kernels_of(trace)
    busy, turns = (t / args.steps for t in covered(kernels))
    print(f"{llm.config.num_hidden_layers} layers, {len(kernels) / args.steps:.0f} kernels a step; a step "
          f"{wall:.0f} us wall, kernels cover {busy:.0f} us, idle {wall - busy:.0f}; in the trace, gaps over 20 us "
          f"{turns:.0f} us a step (the host's turn)")
    for row in table(kernels, args.steps):
        print(f"{row['a_step']:6.1f} x {row['us']:7.2f} us, then {row['gap_after_us']:5.2f} idle  {row['kernel']}")


if __name__ == "__main__":
    main()
