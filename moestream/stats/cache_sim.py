"""Cache policies replayed over a routing trace (trace.py): what hit rate a GPU pool of a given size could reach.

A lookup is one distinct expert needed by one layer step (counters.py), in the step's expert order; a hit is a
lookup whose record is resident. Policies, for a pool of `slots` records:

- `lru`: least recently used, over all layers; `lfu`: least frequently used so far (counts over the whole trace
  up to now, ties to the least recent), every miss inserted;
- `min`: Belady's optimum, offline: a miss evicts the resident record used again farthest ahead, or is not kept
  at all when its own next use is farther still (the best any policy that fetches on demand can do);
- the engine's own policy is replayed with the pool's own code, in experts/replay.py.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict

from moestream.stats.trace import Trace


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
