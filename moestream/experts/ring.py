"""The prefill ring (the seed, DESIGN.md section 3), mixed into StreamingProvider.

Per layer the chunk's most used experts, up to the layer's pool share, go to the pool and stay for decode;
the rest stream through `ring_slots` device slots in batches of `ring_group`, each batch's copies sharing one
event that the compute stream waits on (fetched[b]), and each ring slot refilled only after the compute event of
the batch that last read it (done[b]). Across layers (`ring_lookahead`), a long prompt's next layer needs all its
non-resident records, so their fetches start as soon as this layer's batches are enqueued (`_speculate`); a guess
that turns out wrong costs a copy, never a result, as every slot still holds the record its batch asks for.
"""

from __future__ import annotations

from collections.abc import Iterator

from moestream.experts.grouping import ExpertBatch, Grouping, batch_of


class RingPath:
    """Uses the provider's pool, fetcher, stats, profiler and `_lookup` / `_fetch` / `_wait` / `_done`."""

    _speculated: tuple[int, dict] | None = None  # (layer, {ring position: (record id, future)})

    @property
    def _batch_size(self) -> int:
        """Experts per ring batch: a batch's copies go out together, so at most one per ring slot."""
        return min(self.cfg.ring_group, self.pool.ring_slots)

    def _ring_path(self, layer: int, g: Grouping, speculated: dict) -> Iterator[ExpertBatch]:
        """`speculated`: {ring position: (record id, future)} fetched for this layer by `_speculate`."""
        self.stats.at(layer, self.cfg.precision).prefill_steps += 1
        prof = self.profiler.begin(layer)
        share = self.pool.num_slots // self.geometry.num_layers
        ranked = sorted(range(len(g.experts)), key=lambda j: -g.counts[j])  # stable: ties keep expert order
        keep = set(ranked[:share])
        rids = [self.geometry.rid(layer, e) for e in g.experts]
        slots = [self._lookup(layer, rid) for rid in rids]  # first every hit, pinned before any fill evicts
        waits = [self.pool.pending[s] if s is not None else None for s in slots]
        # The layer keeps up to `share` records: fills take the slots of its residents unused by this step
        # first, then free slots or those of layers above their share, so no fill leaves a layer short.
        used, idle = set(g.experts), []
        for e in range(self.geometry.num_experts):
            slot = None if e in used else self.pool.slot_of.get(self.geometry.rid(layer, e))
            if slot is not None:
                idle.append(slot)
        room = share - len(idle) - sum(s is not None for s in slots)
        spare = self.pool.spare(layer, share, self.geometry.num_experts) if room > 0 else []
        fills, ring_jobs = [], []  # (expert index, rid, slot)
        for j, rid in enumerate(rids):
            if slots[j] is not None:
                continue
            slot = None
            if j in keep and idle:  # fills the pool (base precision) and stays for decode
                slot = self.pool.allocate(rid, idle.pop())
            elif j in keep and room > 0 and spare:
                slot = self.pool.allocate(rid, spare.pop(0))
                room -= 1
            if slot is not None:
                self.pool.pin(slot)
                fills.append((j, rid, slot))
            else:
                slot = self.pool.ring_slot(len(ring_jobs))
                ring_jobs.append((j, rid, slot))
            slots[j] = slot
        # Residents already in place compute first, in one batch, while the copies stream; the rest follow
        # in expert order, `ring_group` at a time (a batch's composition never changes a row's arithmetic).
        fetched = {j for j, _, _ in fills + ring_jobs}
        present = [j for j, w in enumerate(waits) if j not in fetched and (w is None or w.done())]
        rest = sorted(set(range(len(slots))) - set(present))
        group, ring = self._batch_size, self.pool.ring_slots
        batches = ([present] if present else []) + [rest[i: i + group] for i in range(0, len(rest), group)]
        batch_of_job = {j: b for b, idx in enumerate(batches) for j in idx}
        # Each batch's fetches go out together (one copy event a batch: the seed's fetched[b]). A ring job
        # reuses the slot of ring job r - RING, so its batch may start once that job's batch is done.
        fills_of, ring_of, gate = [[] for _ in batches], [[] for _ in batches], [-1] * len(batches)
        for j, rid, slot in fills:
            fills_of[batch_of_job[j]].append((j, rid, slot))
        for r, (j, rid, slot) in enumerate(ring_jobs):
            guess = speculated.get(r)
            if guess is not None and guess[0] == rid:  # already on its way into this very slot
                waits[j] = guess[1]
                self.stats.at(layer, self.miss_precision).prefetch_used += 1
                continue
            b = batch_of_job[j]
            ring_of[b].append((j, rid, slot))
            gate[b] = max(gate[b], batch_of_job[ring_jobs[r - ring][0]] if r >= ring else -1)
        submitted = 0

        def submit_ready(done_batch: int) -> None:
            nonlocal submitted
            while submitted < len(batches) and gate[submitted] <= done_batch:
                fills = {}
                for job in fills_of[submitted]:
                    fills.setdefault(self._fill_precision(job[1]), []).append(job)
                for jobs, precision, is_ring in ([(jobs, p, False) for p, jobs in fills.items()]
                                                 + [(ring_of[submitted], self.miss_precision, True)]):
                    items = [(rid, slot) for _, rid, slot in jobs]
                    for (j, _, _), f in zip(jobs, self._fetch(layer, items, precision, ring=is_ring) if jobs else ()):
                        waits[j] = f
                submitted += 1

        submit_ready(-1)
        for b, idx in enumerate(batches):
            for precision, part in self._by_precision([(j, slots[j], waits[j]) for j in idx]):
                self._wait(layer, [s for _, s, _ in part], [w for _, _, w in part])
                begin = self.profiler.mark()
                yield batch_of(g, [j for j, _, _ in part], self.pool.buffer, self.layouts[precision],
                               [s for _, s, _ in part])
                if prof is not None:
                    prof["compute"].append((begin, self.profiler.mark()))
            self._done([slots[j] for j in idx])
            submit_ready(b)
        self.profiler.end(prof)
        self._speculate(layer + 1, len(g.order))

    def _speculate(self, layer: int, entries: int) -> None:
        """Once a layer's batches are all enqueued every ring slot's last reader is known, so the next layer's
        first RING ring fetches can start, to overlap this layer's tail and the next attention. A step of
        `entries` >= 8 per expert uses every expert (an expert is missed with odds e**-8), and a layer holding
        its pool share makes no pool fills, so its ring asks for its non-resident records in expert order."""
        g, self._speculated = self.geometry, None
        if not self.cfg.ring_lookahead or layer >= g.num_layers or entries < 8 * g.num_experts:
            return
        missing = [rid for rid in (g.rid(layer, e) for e in range(g.num_experts)) if rid not in self.pool.slot_of]
        if g.num_experts - len(missing) < self.pool.num_slots // g.num_layers:
            return
        items = [(rid, self.pool.ring_slot(r)) for r, rid in enumerate(missing[: self.pool.ring_slots])]
        if items:
            # a fetch call's copies share one ready event: one call a ring batch, so the next layer's first batch
            # waits for its own copies, not for all RING of them
            group = self._batch_size
            futures = [f for i in range(0, len(items), group)
                       for f in self._fetch(layer, items[i: i + group], self.miss_precision, ring=True, early=True)]
            self._speculated = (layer, {r: (rid, f) for r, ((rid, _), f) in enumerate(zip(items, futures))})
            self.stats.at(layer, self.miss_precision).prefetch_issued += len(items)
