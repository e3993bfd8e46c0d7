"""Cache policies replayed over a routing trace (trace.py): what hit rate a GPU pool of a given size could reach.

A lookup is one distinct expert needed by one layer step (counters.py), in the step's expert order; a hit is a
lookup whose record is resident. Policies, for a pool of `slots` records:

- `lru`: least recently used, over all layers; `lfu`: least frequently used so far (counts over the whole trace
  up to now, ties to the least recent), every miss inserted;
- `min`: Belady's optimum, offline: a miss evicts the resident record used again farthest ahead, or is not kept
  at all when its own next use is farther still (the best any policy that fetches on demand can do);
- `engine`: the engine's own policy, slot by slot as pool.py, decode.py and ring_plan.py run it. A step of at least
  `prefill_min_rows` rows, or of more distinct experts than slots, is a ring step: its hits are pinned, its most
  used experts take the layer's idle slots and then free slots or slots of layers above their share (slots //
  layers), and the rest stream through the ring, never cached. Any other step is a decode step: hits pinned,
  misses take the least recently used unpinned slots. Decode lookahead (layer L+1's experts guessed from layer L's
  hidden state) cannot be known from a trace, so `engine` is the engine with `--no-lookahead`; `lookahead=True`
  models a perfect guess (the next layer's actual experts), an upper bound of what lookahead adds.
  With `preloaded`, a pool that holds every record starts full, as the engine preloads one on CUDA.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict

from moestream.stats.trace import Trace

POLICIES = ("lru", "lfu", "engine", "min")


def lookups(trace: Trace) -> list[int]:
    """Record ids (layer * experts + expert) of every lookup, in order."""
    out = []
    for s in trace.steps:
        out += [s.layer * trace.experts + e for e in sorted({e for row in s.rows for e in row})]
    return out


def lru(seq: list[int], slots: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in seq:
        if r in cache:
            hits += 1
            cache.move_to_end(r)
        elif slots > 0:
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[r] = None
    return hits


def lfu(seq: list[int], slots: int) -> int:
    freq: Counter[int] = Counter()
    last: dict[int, int] = {}  # resident record -> time of its last use
    heap: list[tuple[int, int, int]] = []  # (freq, last use, record), stale entries skipped
    hits = 0
    for t, r in enumerate(seq):
        freq[r] += 1
        if r in last:
            hits += 1
        elif slots <= 0:
            continue
        elif len(last) >= slots:
            while True:
                f, u, victim = heapq.heappop(heap)
                if last.get(victim) == u and freq[victim] == f:
                    break
            del last[victim]
        last[r] = t
        heapq.heappush(heap, (freq[r], t, r))
    return hits


def belady(seq: list[int], slots: int) -> int:
    never = len(seq)
    next_use = [never] * len(seq)
    seen: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = seen.get(seq[i], never)
        seen[seq[i]] = i
    cache: dict[int, int] = {}  # record -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, record), stale entries skipped
    hits = 0
    for i, r in enumerate(seq):
        if r in cache:
            hits += 1
        elif slots <= 0:
            continue
        elif len(cache) >= slots:
            while True:
                nu, victim = heapq.heappop(heap)
                if cache.get(victim) == -nu:
                    break
            if -nu <= next_use[i]:  # the newcomer is needed last: keep the pool as it is
                heapq.heappush(heap, (nu, victim))
                continue
            del cache[victim]
        cache[r] = next_use[i]
        heapq.heappush(heap, (-next_use[i], r))
    return hits


class _Pool:
    """pool.py's residency decisions, with no buffers and no fetches."""

    def __init__(self, slots: int):
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))
        self.rid_of: list[int | None] = [None] * slots
        self.slot_of: dict[int, int] = {}
        self.pinned: set[int] = set()

    def lookup(self, rid: int) -> int | None:
        slot = self.slot_of.get(rid)
        if slot is not None:
            self.lru.move_to_end(slot)
        return slot

    def allocate(self, rid: int, slot: int | None = None) -> int | None:
        if slot is None:
            slot = next((s for s in self.lru if s not in self.pinned), None)
            if slot is None:
                return None
        if self.rid_of[slot] is not None:
            del self.slot_of[self.rid_of[slot]]
        self.rid_of[slot], self.slot_of[rid] = rid, slot
        self.lru.move_to_end(slot)
        return slot

    def spare(self, layer: int, share: int, experts: int) -> list[int]:
        held = Counter(rid // experts for rid in self.slot_of)
        out = []
        for slot in self.lru:
            rid = self.rid_of[slot]
            owner = None if rid is None else rid // experts
            if owner is None or (owner != layer and held[owner] > share and slot not in self.pinned):
                out.append(slot)
                if owner is not None:
                    held[owner] -= 1
        return out


def engine(trace: Trace, slots: int, lookahead: bool = False, preloaded: bool = False) -> int:
    slots = min(slots, trace.records)
    if slots <= 0:
        return 0
    pool, n, hits = _Pool(slots), trace.experts, 0
    if preloaded and slots >= trace.records:
        for rid in range(trace.records):
            pool.allocate(rid)
    for i, s in enumerate(trace.steps):
        counts = Counter(e for row in s.rows for e in row)
        experts = sorted(counts)
        rids = [s.layer * n + e for e in experts]
        pool.pinned.clear()
        found = [pool.lookup(r) for r in rids]
        pool.pinned.update(f for f in found if f is not None)
        hits += sum(f is not None for f in found)
        if len(s.rows) >= trace.prefill_min_rows or len(experts) > slots:
            _ring_fills(pool, s.layer, [counts[e] for e in experts], rids, found, slots // trace.layers, n)
            continue
        for r, f in zip(rids, found):
            if f is None:
                pool.pinned.add(pool.allocate(r))
        nxt = trace.steps[i + 1] if i + 1 < len(trace.steps) else None
        if lookahead and nxt is not None and nxt.layer == s.layer + 1 and len(nxt.rows) == len(s.rows):
            for e in sorted({e for row in nxt.rows for e in row}):
                if pool.lookup(nxt.layer * n + e) is None and pool.allocate(nxt.layer * n + e) is None:
                    break
    return hits


def _ring_fills(pool: _Pool, layer: int, counts: list[int], rids: list[int], found: list, share: int,
                experts: int) -> None:
    """ring_plan.py's fills: the step's most used experts take the layer's idle slots, then spare ones."""
    used = set(rids)
    idle = [pool.slot_of[r] for r in range(layer * experts, (layer + 1) * experts)
            if r not in used and r in pool.slot_of]
    room = share - len(idle) - sum(f is not None for f in found)
    spare = pool.spare(layer, share, experts) if room > 0 else []
    keep = set(sorted(range(len(counts)), key=lambda j: -counts[j])[:share])
    fills = []
    for j in range(len(counts)):
        if found[j] is not None or j not in keep:
            continue
        if idle:
            fills.append((rids[j], idle.pop()))
        elif room > 0 and spare:
            fills.append((rids[j], spare.pop(0)))
            room -= 1
    for rid, slot in fills:
        pool.allocate(rid, slot)
        pool.pinned.add(slot)


def reuse(trace: Trace) -> list[float | None]:
    """Per layer: the mean fraction of token t+1's experts that token t used too (None: fewer than two tokens)."""
    prev: list[set | None] = [None] * trace.layers
    total, pairs = [0.0] * trace.layers, [0] * trace.layers
    for s in trace.steps:
        for row in s.rows:
            cur = set(row)
            if prev[s.layer] is not None:
                total[s.layer] += len(cur & prev[s.layer]) / len(cur)
                pairs[s.layer] += 1
            prev[s.layer] = cur
    return [t / p if p else None for t, p in zip(total, pairs)]


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
