"""The engine's own cache policy replayed over a routing trace (stats/trace.py), with the pool's and the prefill
ring's own code (pool.py, ring_plan.py) and no buffers or fetches, beside the generic policies of
stats/cache_sim.py: `simulate` is what `moestream simulate` prints.

`engine`: a step of at least `prefill_min_rows` rows, or of more distinct experts than slots, is a ring step (hits
pinned, fills as `plan_ring` plans them, the rest streamed and never cached); any other is a decode step (hits
pinned, misses into the slots the pool's eviction picks). Decode lookahead guesses layer L+1's experts from layer
L's hidden state, which a trace cannot know: `engine` is the engine with `--no-lookahead`, and `lookahead=True`
models a perfect guess (the next layer's actual experts), an upper bound of what lookahead adds. With `preloaded`,
a pool that holds every record starts full, as the engine preloads one on CUDA.
"""

from __future__ import annotations

from collections import Counter

import torch

from moestream.experts.pool import ExpertPool
from moestream.experts.ring_plan import plan_ring
from moestream.stats.cache_sim import belady, lfu, lookups, lru, reuse
from moestream.stats.trace import Trace

POLICIES = ("lru", "lfu", "engine", "min")


def engine(trace: Trace, slots: int, lookahead: bool = False, preloaded: bool = False) -> int:
    """Hits of the engine's policy with a pool of `slots` records."""
    slots = min(slots, trace.records)
    if slots <= 0:
        return 0
    pool, n, hits = ExpertPool(slots, 1, 0, torch.device("cpu")), trace.experts, 0
    if preloaded and slots >= trace.records:
        for rid in range(trace.records):
            pool.allocate(rid)
    for i, s in enumerate(trace.steps):
        counts = Counter(e for row in s.rows for e in row)
        experts = sorted(counts)
        rids = [s.layer * n + e for e in experts]
        pool.new_step()
        found = [pool.lookup(r) for r in rids]
        for slot in found:
            if slot is not None:
                pool.pin(slot)
        hits += sum(f is not None for f in found)
        if s.size >= trace.prefill_min_rows or len(experts) > slots:
            idle, spare, room, share = pool.ring_room(s.layer, set(experts), sum(f is not None for f in found),
                                                      trace.layers, n)
            plan = plan_ring([counts[e] for e in experts], rids, found, [True] * len(rids), idle, spare, room,
                             share, pool.ring_slot(0), pool.ring_slots, 1, {})
            for j in plan.fills:
                pool.allocate(rids[j], plan.slots[j])
                pool.pin(plan.slots[j])
            continue
        for r, f in zip(rids, found):
            if f is None and (slot := pool.allocate(r)) is not None:
                pool.pin(slot)
        nxt = trace.steps[i + 1] if i + 1 < len(trace.steps) else None
        if lookahead and nxt is not None and nxt.layer == s.layer + 1 and len(nxt.rows) == len(s.rows):
            for e in sorted({e for row in nxt.rows for e in row}):
                if pool.lookup(nxt.layer * n + e) is None and pool.allocate(nxt.layer * n + e) is None:
                    break
    return hits


def simulate(trace: Trace, slots: list[int], lookahead: bool = False, preloaded: bool = False) -> dict:
    """Hits of every policy at each pool size (in records), and the reuse per layer."""
    seq = lookups(trace)
    policies = {"lru": lambda n: lru(seq, n), "lfu": lambda n: lfu(seq, n),
                "engine": lambda n: engine(trace, n, False, preloaded), "min": lambda n: belady(seq, n)}
    if lookahead:
        policies["engine+ahead"] = lambda n: engine(trace, n, True, preloaded)
    hits = {name: [run(n) for n in slots] for name, run in policies.items()}
    return {"records": trace.records, "lookups": len(seq), "compulsory": len(set(seq)), "slots": list(slots),
            "hits": hits, "hit_rate": {k: [h / len(seq) if seq else 0.0 for h in v] for k, v in hits.items()},
            "reuse": reuse(trace), "reuse_if_uniform": trace.top_k / trace.experts}
