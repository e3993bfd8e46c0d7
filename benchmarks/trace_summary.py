"""What a prefill timeline says about overlap: busy time of the copies and of the kernels, how much of each
ran at the same time, and the GPU's idle time, from a torch.profiler Chrome trace (bench_e2e --trace).

python -m benchmarks.trace_summary TRACE.json[.gz]
"""

from __future__ import annotations

import gzip
import json
import sys


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


def summarize(path: str) -> dict:
    """Seconds: `copy` (host-to-device copies busy), `compute` (kernels busy), `both` (at once), `wall`
    (first GPU event to last), `idle` (neither)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    copy, compute = _union(copies), _union(kernels)
    busy = _union(copy + compute)
    if not busy:
        return {}
    wall = busy[-1][1] - busy[0][0]
    us = 1e-6
    return {"copy_s": _length(copy) * us, "compute_s": _length(compute) * us,
            "both_s": _intersection(copy, compute) * us, "wall_s": wall * us,
            "idle_s": (wall - _length(busy)) * us}


def main() -> None:
    for path in sys.argv[1:]:
        s = summarize(path)
        print(f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
