"""Expert-cache counters as plain data, per record layer and per precision.

Definitions: a lookup is one distinct expert needed by one layer step; it is a hit when the record is
in the GPU pool (or on its way there), else a miss. Reads count the records each tier served:
`gpu` = pool hits, `host` = misses copied from the pinned host tier, `disk` = misses read from disk;
bytes = records x record stride. Prefetches are lookahead fetches (decode: layer L+1's predicted experts;
prefill: the next layer's first ring records); `prefetch_used` counts those that were hit before eviction or,
in the ring, taken by the step they were fetched for.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

TIERS = ("gpu", "host", "disk")


@dataclass
class TierCounter:
    records: int = 0
    bytes: int = 0


@dataclass
class LayerCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    reads: dict[str, TierCounter] = field(default_factory=lambda: {t: TierCounter() for t in TIERS})
    read_seconds: float = 0.0  # worker time inside disk reads
    io_wait_seconds: float = 0.0  # compute-side time blocked until fetches were enqueued
    ring_wait_seconds: float = 0.0  # time blocked until the GPU released a staging buffer or ring slot
    prefill_steps: int = 0
    decode_steps: int = 0


class ExpertStats:
    """Counters for every (record layer, precision); thread-safe updates from reader threads."""

    def __init__(self, num_layers: int, num_experts: int = 0):
        self.layers: list[dict[str, LayerCounters]] = [dict() for _ in range(num_layers)]
        self.expert_uses = [[0] * num_experts for _ in range(num_layers)]  # lookups per (layer, expert)
        self.resident: list[list[int]] = [[] for _ in range(num_layers)]  # filled by the provider on snapshot
        self.lock = threading.Lock()
        self.direct_io: bool | None = None
        self.timings: list[dict] = []  # per prefill layer: copy, compute and wall seconds (when profiled)

    def at(self, layer: int, precision: str) -> LayerCounters:
        per = self.layers[layer]
        if precision not in per:
            per[precision] = LayerCounters()
        return per[precision]

    def read(self, layer: int, precision: str, tier: str, nbytes: int, seconds: float = 0.0, records: int = 1) -> None:
        """`records` reads of `nbytes` bytes in all."""
        with self.lock:
            c = self.at(layer, precision)
            c.reads[tier].records += records
            c.reads[tier].bytes += nbytes
            c.read_seconds += seconds

    def snapshot(self) -> dict:
        with self.lock:
            layers = [{p: asdict(c) for p, c in per.items()} for per in self.layers]
            totals = self._totals()
        experts = [{"uses": list(u), "resident": list(r)} for u, r in zip(self.expert_uses, self.resident)]
        return {"direct_io": self.direct_io, "layers": layers, "totals": totals, "experts": experts,
                "prefill_timings": list(self.timings)}

    def totals(self) -> dict:
        """The counters summed over layers, per precision (`snapshot()["totals"]`, read per request and per scrape
        without copying every layer)."""
        with self.lock:
            return self._totals()

    def _totals(self) -> dict:
        totals: dict = {}
        for per in self.layers:
            for p, c in per.items():
                t = totals.setdefault(p, {k: 0 for k in vars(c) if k != "reads"} | {"reads": {}})
                for k, v in vars(c).items():
                    if k == "reads":
                        for tier, rb in v.items():
                            tt = t["reads"].setdefault(tier, {"records": 0, "bytes": 0})
                            tt["records"] += rb.records
                            tt["bytes"] += rb.bytes
                    else:
                        t[k] += v
        return totals


def delta(before: dict, after: dict) -> dict:
    """`after - before` for two `snapshot()["totals"]`: what one request did."""
    out = {}
    for precision, a in after.items():
        b = before.get(precision, {})
        out[precision] = {k: (v - b.get(k, 0) if not isinstance(v, dict) else
                              {t: {m: n - b.get(k, {}).get(t, {}).get(m, 0) for m, n in tv.items()}
                               for t, tv in v.items()}) for k, v in a.items()}
    return out
