"""The prefill ring's executor: runs a layer's `RingPlan` (ring_plan.py) on the pool and the fetcher.

Each batch's fetches go out together, sharing one copy event that the compute stream waits on (the seed's
fetched[b]); a batch's fetches start once the batch its ring slots wait for is done (its gate, done[b]). Once a
layer's batches are all enqueued, a long prompt's next layer needs every record it has not kept, so their
fetches start at once (`speculate`): a `RingAhead` that the next layer's step takes. A wrong guess costs a copy,
never a result, as every slot still holds the record its batch asks for.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from moestream.experts.grouping import ExpertBatch, Grouping, batch_of
from moestream.experts.residency import Residency
from moestream.experts.ring_plan import plan_ring


@dataclass(frozen=True)
class RingAhead:
    """Fetches started for `layer`'s ring before its step: ring position -> (record id, future)."""

    layer: int
    fetches: dict[int, tuple]


class RingPath:
    def __init__(self, residency: Residency, ring_group: int, lookahead: bool, keep: list[bool] | None = None):
        """`keep`: by expert id, the experts this rank holds (experts/sharding.py), the only ones it fetches ahead."""
        self.res, self.lookahead, self.keep = residency, lookahead, keep
        self.group = min(ring_group, residency.pool.ring_slots)  # a batch's copies go out together: one a slot

    def batches(self, layer: int, g: Grouping, ahead: RingAhead | None) -> Generator[ExpertBatch, None, RingAhead]:
        """Yields the layer's batches; returns the fetches started early for the next layer (or None)."""
        res, pool, geometry = self.res, self.res.pool, self.res.geometry
        res.stats.at(layer, res.base).prefill_steps += 1
        prof = res.profiler.begin(layer)
        rids = [geometry.rid(layer, e) for e in g.experts]
        hits = res.lookups(layer, rids)  # every hit first, pinned before any fill evicts
        if None not in hits and all(pool.pending[s] is None and pool.ready[s] is None and pool.precision_of[s] ==
                                    res.base for s in hits):
            # every record resident, landed and waited on (a resident prefill): the plan's one batch, without
            # planning it, while the GPU waits on this thread
            yield from self._timed(prof, batch_of(g, list(range(len(hits))), pool.buffer, res.layouts[res.base], hits))
            res.done(hits)
            res.profiler.end(prof)
            return self.speculate(layer + 1, len(g.order))
        waits = [pool.pending[s] if s is not None else None for s in hits]
        idle, spare, room, share = pool.ring_room(layer, set(g.experts), sum(s is not None for s in hits),
                                                  geometry.num_layers, geometry.num_experts)
        guesses = ahead.fetches if ahead is not None and ahead.layer == layer else {}
        plan = plan_ring(g.counts, rids, hits, [w is None or w.done() for w in waits], idle, spare, room, share,
                         pool.ring_slot(0), pool.ring_slots, self.group, {r: rid for r, (rid, _) in guesses.items()})
        for j in plan.fills:  # fills the pool (base precision) and stays for decode
            pool.allocate(rids[j], plan.slots[j])
            pool.pin(plan.slots[j])
        for j, r in plan.taken.items():
            waits[j] = guesses[r][1]
            res.stats.at(layer, res.miss).prefetch_used += 1
        submitted = 0

        def submit_ready(done_batch: int) -> None:
            nonlocal submitted
            while submitted < len(plan.batches) and plan.gates[submitted] <= done_batch:
                fills, ring = plan.fetches[submitted]
                by_precision = {}
                for j in fills:
                    by_precision.setdefault(res.fill_precision(rids[j]), []).append(j)
                for jobs, precision, is_ring in ([(jobs, p, False) for p, jobs in by_precision.items()]
                                                 + [(ring, res.miss, True)]):
                    items = [(rids[j], plan.slots[j]) for j in jobs]
                    for j, future in zip(jobs, res.fetch(layer, items, precision, ring=is_ring) if jobs else ()):
                        waits[j] = future
                submitted += 1

        submit_ready(-1)
        for b, idx in enumerate(plan.batches):
            for precision, part in res.by_precision([(j, plan.slots[j], waits[j]) for j in idx]):
                res.wait(layer, [s for _, s, _ in part], [w for _, _, w in part])
                yield from self._timed(prof, batch_of(g, [j for j, _, _ in part], pool.buffer, res.layouts[precision],
                                                      [s for _, s, _ in part]))
            res.done([plan.slots[j] for j in idx])
            submit_ready(b)
        res.profiler.end(prof)
        return self.speculate(layer + 1, len(g.order))

    def _timed(self, prof: dict | None, batch: ExpertBatch) -> Generator[ExpertBatch, None, None]:
        """Yields `batch`; when profiling, the compute it was given goes into the layer's profile."""
        begin = self.res.profiler.mark()
        yield batch
        if prof is not None:
            prof["compute"].append((begin, self.res.profiler.mark()))

    def speculate(self, layer: int, entries: int) -> RingAhead | None:
        """The next layer's first RING ring fetches, started now to overlap this layer's tail and the next
        attention. A step of `entries` >= 8 per expert uses every expert (one is missed with odds e**-8), and a
        layer holding its pool share makes no pool fills, so its ring asks for its non-resident records in order."""
        res, g, pool = self.res, self.res.geometry, self.res.pool
        if not self.lookahead or layer >= g.num_layers or entries < 8 * g.num_experts:
            return None
        experts = [e for e in range(g.num_experts) if self.keep is None or self.keep[e]]
        missing = [rid for rid in (g.rid(layer, e) for e in experts) if rid not in pool.slot_of]
        if len(experts) - len(missing) < pool.num_slots // g.num_layers:
            return None
        items = [(rid, pool.ring_slot(r)) for r, rid in enumerate(missing[: pool.ring_slots])]
        if not items:
            return None
        # a fetch call's copies share one ready event: one call a ring batch, so the next layer's first batch
        # waits for its own copies, not for all RING of them
        futures = [f for i in range(0, len(items), self.group)
                   for f in res.fetch(layer, items[i: i + self.group], res.miss, ring=True, early=True)]
        res.stats.at(layer, res.miss).prefetch_issued += len(items)
        return RingAhead(layer, {r: (rid, f) for r, ((rid, _), f) in enumerate(zip(items, futures))})
