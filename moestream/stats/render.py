"""Renderers for the counters (stats/counters.py): a one-line request summary and rich tables.

Input is the plain dict of `LLM.stats()` (or the `engine` part of a server's /v1/stats); these
functions only format it."""

from __future__ import annotations

from rich.table import Table


def _rate(hits: int, lookups: int) -> str:
    return f"{hits / lookups:.0%}" if lookups else "-"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def one_line(experts: dict) -> str:
    """What the expert cache did for one request (the `experts` part of a request's stats)."""
    parts = []
    for precision, c in experts.items():
        r = c["reads"]
        parts.append(f"{precision}: {_rate(c['hits'], c['lookups'])} hits ({c['hits']}/{c['lookups']}), read "
                     f"{_gb(r['disk']['bytes'])} GB from disk, {_gb(r['host']['bytes'])} GB from host, prefetched "
                     f"{c['prefetch_issued']} ({c['prefetch_used']} used)")
    return "experts " + "; ".join(parts) if parts else "experts: no lookups"


def summary_table(stats: dict) -> Table:
    t = Table(title="expert cache")
    for col in ("precision", "lookups", "hit rate", "misses", "prefetched (used)", "disk GB", "host GB",
                "read s", "io wait s", "ring wait s"):
        t.add_column(col, justify="right")
    for precision, c in stats.get("totals", {}).items():
        r = c["reads"]
        t.add_row(precision, str(c["lookups"]), _rate(c["hits"], c["lookups"]), str(c["misses"]),
                  f"{c['prefetch_issued']} ({c['prefetch_used']})", _gb(r["disk"]["bytes"]), _gb(r["host"]["bytes"]),
                  f"{c['read_seconds']:.2f}", f"{c['io_wait_seconds']:.2f}", f"{c['ring_wait_seconds']:.2f}")
    pool = stats.get("pool")
    if pool:
        t.caption = (f"pool {pool['resident']}/{pool['slots']} records resident ({pool['precision']}, "
                     f"{pool['stride'] / 1e6:.2f} MB each), ring {pool['ring_slots']}, host tier {pool['host_slots']}; "
                     f"O_DIRECT {'on' if stats.get('direct_io') else 'off'}")
    for rank in stats.get("ranks", []):  # experts spread over GPUs: each one's share
        p, totals = rank["pool"], rank["totals"].values()
        hits, lookups = sum(c["hits"] for c in totals), sum(c["lookups"] for c in totals)
        t.caption += (f"\nGPU {rank['rank']}: pool {p['resident']}/{p['slots']}, {_rate(hits, lookups)} hits "
                      f"({hits}/{lookups}), host tier {p['host_slots']}")
    return t


def layers_table(stats: dict) -> Table:
    t = Table(title="per layer")
    for col in ("layer", "precision", "lookups", "hit rate", "misses", "disk GB", "host GB", "read s", "prefills",
                "decodes"):
        t.add_column(col, justify="right")
    for i, per in enumerate(stats.get("layers", [])):
        for precision, c in per.items():
            r = c["reads"]
            t.add_row(str(i), precision, str(c["lookups"]), _rate(c["hits"], c["lookups"]), str(c["misses"]),
                      _gb(r["disk"]["bytes"]), _gb(r["host"]["bytes"]), f"{c['read_seconds']:.2f}",
                      str(c["prefill_steps"]), str(c["decode_steps"]))
    return t


def experts_table(stats: dict, layer: int, limit: int = 32) -> Table:
    info = stats.get("experts", [])
    if not 0 <= layer < len(info):
        raise IndexError(f"layer {layer} is out of range (0..{len(info) - 1})")
    uses, resident = info[layer]["uses"], set(info[layer]["resident"])
    t = Table(title=f"layer {layer}: most used experts ({len(resident)} resident)")
    for col in ("expert", "uses", "share", "resident"):
        t.add_column(col, justify="right")
    total = sum(uses) or 1
    for e in sorted(range(len(uses)), key=lambda e: -uses[e])[:limit]:
        t.add_row(str(e), str(uses[e]), f"{uses[e] / total:.1%}", "yes" if e in resident else "")
    return t
