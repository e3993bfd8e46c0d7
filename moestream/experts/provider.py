"""The one seam between the MoE layers and the expert subsystem.

`batches(layer_slot, topk_ids, x)` yields `ExpertBatch`es of experts whose records are on the device (or
whose copies the compute stream already waits for). Two paths, with the same results:
- pool path (decode, few rows): hits compute at once; misses get pool slots (LRU, never evicting a slot
  this step uses) and fetches; then layer L+1's router on the current hidden state predicts L+1's
  experts, and their fetches start after L's misses (one-layer lookahead).
- ring path (prefill): the layer's most-used experts, up to the pool's per-layer share, are fetched into
  the pool and stay for decode; the rest stream through the ring in batches of `ring_group`, each ring
  slot reused only after the batch that last read it is done (the seed's two-event protocol).
Mixed mode (`miss_precision`): demand and ring misses are fetched at Q3/Q2, pool fills and lookahead at
Q4, and a cached record keeps its precision; a batch holds one precision.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from moestream.config import ExpertConfig
from moestream.experts.budget import pool_slots_for
from moestream.experts.fetch import Fetcher, FetchRequest
from moestream.experts.graphmode import GraphMode
from moestream.experts.grouping import ExpertBatch, Grouping, batch_of, group_by_expert
from moestream.experts.host import HostTier
from moestream.experts.memory import Device
from moestream.experts.pool import ExpertPool
from moestream.experts.profile import Profiler
from moestream.experts.reads import RecordReader
from moestream.experts.store import Store
from moestream.stats.counters import ExpertStats


class StreamingProvider(GraphMode):
    def __init__(self, store: Store, cfg: ExpertConfig, device: torch.device, top_k: int):
        self.cfg, self.geometry, self.top_k = cfg, store.manifest.geometry, top_k
        self.miss_precision = cfg.miss_precision or cfg.precision
        self.layouts = {p: store.manifest.layouts[p] for p in {cfg.precision, self.miss_precision}}
        self.layout = self.layouts[cfg.precision]
        stride = max(layout.stride for layout in self.layouts.values())
        self.device = Device(device, cfg.io_timeout_s)
        self.stats = ExpertStats(self.geometry.num_layers, self.geometry.num_experts)
        self.pool = ExpertPool(pool_slots_for(store, cfg, device, top_k, stride), cfg.ring_slots, stride, device)
        readers = {p: RecordReader(store.experts_path(p), layout.stride, self.geometry.num_records, cfg.direct_io)
                   for p, layout in self.layouts.items()}
        self.stats.direct_io = all(r.direct for r in readers.values())
        self.io_note = next((r.fallback_reason for r in readers.values() if r.fallback_reason), None)
        host_slots = max(1, int(cfg.host_gb * 1e9 // stride))
        self.host = HostTier(host_slots, stride, self.device.cuda) if cfg.host_gb else None
        self.fetcher = Fetcher(self.device, readers, self.host, self.stats, cfg.read_threads, cfg.staging_records,
                               cfg.fake_reads)
        self.profiler = Profiler(cfg.profile and self.device.cuda)
        self.routers: dict[int, torch.Tensor] = {}  # layer slot -> router weight, for lookahead
        self._addresses, self._table_state = None, None  # graph mode (graphmode.py)
        self._addressed: list[torch.Tensor] = []  # expert ids of graph-mode steps not counted yet

    def attach(self, routers: dict[int, torch.Tensor]) -> None:
        self.routers = routers

    # -- the seam -------------------------------------------------------------------------------------
    def batches(self, layer_slot: int, topk_ids: torch.Tensor, x: torch.Tensor) -> Iterator[ExpertBatch]:
        self.flush_addressed()  # count earlier graph steps before this step changes residency
        g = group_by_expert(topk_ids, self.geometry.num_experts)
        self.pool.new_step()
        if topk_ids.shape[0] >= self.cfg.prefill_min_rows or len(g.experts) > self.pool.num_slots:
            yield from self._ring_path(layer_slot, g)
        else:
            yield from self._pool_path(layer_slot, g, x)

    # -- decode ---------------------------------------------------------------------------------------
    def _pool_path(self, layer: int, g: Grouping, x: torch.Tensor) -> Iterator[ExpertBatch]:
        self.stats.at(layer, self.cfg.precision).decode_steps += 1
        jobs = []  # (expert index, slot, wait)
        for j, e in enumerate(g.experts):
            rid = self.geometry.rid(layer, e)
            slot = self._lookup(layer, rid)
            jobs.append((j, slot, self.pool.pending[slot] if slot is not None else None))
        misses = [i for i, (_, slot, _) in enumerate(jobs) if slot is None]
        items = []
        for i in misses:  # demand misses: fetched at the miss precision, into distinct (pinned) slots
            rid = self.geometry.rid(layer, g.experts[jobs[i][0]])
            slot = self.pool.allocate(rid)
            self.pool.pin(slot)
            items.append((rid, slot))
        for i, (_, slot), future in zip(misses, items, self._fetch(layer, items, self.miss_precision)):
            jobs[i] = (jobs[i][0], slot, future)
        if self.cfg.lookahead:
            self._prefetch_next(layer, x)
        hits = [job for job in jobs if job[2] is None or job[2].done()]
        later = [job for job in jobs if job not in hits]
        used = []
        for part in (hits, later):  # residents compute at once, the misses after their copies
            for precision, group in self._by_precision(part):
                self._wait(layer, [s for _, s, _ in group], [w for _, _, w in group])
                used += [s for _, s, _ in group]
                yield batch_of(g, [j for j, _, _ in group], self.pool.buffer, self.layouts[precision],
                               [s for _, s, _ in group])
        self._done(used)

    def _prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        router = self.routers.get(layer + 1)
        if router is None:
            return
        predicted = torch.topk(x @ router.T, self.top_k, dim=-1).indices.reshape(-1).unique().tolist()
        c = self.stats.at(layer + 1, self.cfg.precision)
        for e in predicted:
            rid = self.geometry.rid(layer + 1, e)
            if self.pool.lookup(rid) is not None:
                continue
            slot = self.pool.allocate(rid)
            if slot is None:
                break
            self.pool.prefetched.add(rid)
            self._fetch(layer + 1, [(rid, slot)], self.cfg.precision)
            c.prefetch_issued += 1

    # -- prefill --------------------------------------------------------------------------------------
    def _ring_path(self, layer: int, g: Grouping) -> Iterator[ExpertBatch]:
        self.stats.at(layer, self.cfg.precision).prefill_steps += 1
        prof = self.profiler.begin(layer)
        share = self.pool.num_slots // self.geometry.num_layers
        ranked = sorted(range(len(g.experts)), key=lambda j: -g.counts[j])  # stable: ties keep expert order
        keep = set(ranked[:share])
        rids = [self.geometry.rid(layer, e) for e in g.experts]
        slots = [self._lookup(layer, rid) for rid in rids]  # first every hit, pinned before any fill evicts
        waits = [self.pool.pending[s] if s is not None else None for s in slots]
        # The layer keeps up to `share` records: fills take the slots of its residents unused by this step
        # first, then free room, so that filling one layer does not evict the layers after it.
        used, idle = set(g.experts), []
        for e in range(self.geometry.num_experts):
            slot = None if e in used else self.pool.slot_of.get(self.geometry.rid(layer, e))
            if slot is not None:
                idle.append(slot)
        room = share - len(idle) - sum(s is not None for s in slots)
        fills, ring_jobs = [], []  # (expert index, rid, slot)
        for j, rid in enumerate(rids):
            if slots[j] is not None:
                continue
            slot = None
            if j in keep and idle:  # fills the pool (base precision) and stays for decode
                slot = self.pool.allocate(rid, idle.pop())
            elif j in keep and room > 0:
                slot = self.pool.allocate(rid)
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
        group, ring = self.cfg.ring_group, self.pool.ring_slots
        batches = ([present] if present else []) + [rest[i: i + group] for i in range(0, len(rest), group)]
        batch_of_job = {j: b for b, idx in enumerate(batches) for j in idx}
        # Each batch's fetches go out together (one copy event a batch: the seed's fetched[b]). A ring job
        # reuses the slot of ring job r - RING, so its batch may start once that job's batch is done.
        fills_of, ring_of, gate = [[] for _ in batches], [[] for _ in batches], [-1] * len(batches)
        for j, rid, slot in fills:
            fills_of[batch_of_job[j]].append((j, rid, slot))
        for r, (j, rid, slot) in enumerate(ring_jobs):
            b = batch_of_job[j]
            ring_of[b].append((j, rid, slot))
            gate[b] = max(gate[b], batch_of_job[ring_jobs[r - ring][0]] if r >= ring else -1)
        submitted = 0

        def submit_ready(done_batch: int) -> None:
            nonlocal submitted
            while submitted < len(batches) and gate[submitted] <= done_batch:
                for jobs, precision, is_ring in ((fills_of[submitted], self.cfg.precision, False),
                                                 (ring_of[submitted], self.miss_precision, True)):
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

    # -- plumbing -------------------------------------------------------------------------------------
    def _lookup(self, layer: int, rid: int) -> int | None:
        """The record's pool slot (a hit, pinned for this step), or None; counted at the precision used."""
        slot = self.pool.lookup(rid)
        precision = self.pool.precision_of[slot] if slot is not None else self.cfg.precision
        c = self.stats.at(layer, precision)
        c.lookups += 1
        self.stats.expert_uses[layer][rid % self.geometry.num_experts] += 1
        if slot is None:
            c.misses += 1
            return None
        c.hits += 1
        self.stats.read(layer, precision, "gpu", self.layouts[precision].stride)
        self.pool.pin(slot)
        if rid in self.pool.prefetched:
            self.pool.prefetched.discard(rid)
            c.prefetch_used += 1
        return slot

    def _by_precision(self, jobs: list) -> list[tuple[str, list]]:
        groups: dict[str, list] = {}
        for job in jobs:
            groups.setdefault(self.pool.precision_of[job[1]], []).append(job)
        return sorted(groups.items(), key=lambda kv: kv[0] != self.cfg.precision)

    def _fetch(self, layer: int, items: list[tuple[int, int]], precision: str, ring: bool = False) -> list:
        """Fetch records into distinct slots, `items` = [(record id, slot)]; one future per item."""
        if not ring:
            self._table_state = None  # residency changes: graph-mode addresses must be rebuilt
        requests = [FetchRequest(rid, precision, layer, self.pool.views[slot], self.pool.last_use[slot],
                                 self.pool.pending[slot]) for rid, slot in items]
        fetched = self.fetcher.fetch(requests, self._copy_events)
        for (rid, slot), (future, ready) in zip(items, fetched):
            self.pool.pending[slot], self.pool.ready[slot], self.pool.precision_of[slot] = future, ready, precision
            if ring:
                self.pool.rid_of[slot] = rid
        return [future for future, _ in fetched]

    def _copy_events(self) -> tuple:
        """(started, ready) for a copy or a run of copies; `started` only when profiling this layer."""
        started, ready = self.profiler.copy_events(self.device)
        return started, ready or self.device.event()

    def _wait(self, layer: int, slots: list[int], futures: list) -> None:
        """Block until the fetches are enqueued, then make the compute stream wait for their copies."""
        start = time.perf_counter()
        for f in futures:
            if f is not None:
                f.result(timeout=self.cfg.io_timeout_s)
        waited = time.perf_counter() - start
        if waited > 1e-4:
            self.stats.at(layer, self.cfg.precision).io_wait_seconds += waited
        waited_on = None
        for s in slots:
            ready = self.pool.ready[s]
            if ready is not None:  # once waited on, later compute is ordered after the copy
                if ready is not waited_on:  # a run of copies shares one event
                    self.device.wait_on_compute(ready)
                    waited_on = ready
                self.pool.ready[s] = None

    def _done(self, slots: list[int]) -> None:
        done = self.device.event()
        done.record(self.device.compute_stream())
        for s in slots:
            self.pool.last_use[s] = done

    # -- reporting ------------------------------------------------------------------------------------
    def totals(self) -> dict:
        """The counters' totals per precision, with every graph-mode step counted so far."""
        self.flush_addressed()
        return self.stats.snapshot()["totals"]

    def snapshot(self) -> dict:
        """The counters, with which experts of each layer are resident in the GPU pool right now."""
        self.flush_addressed()
        self.stats.timings.extend(self.profiler.resolve(self.device.device) if self.profiler.enabled else [])
        n = self.geometry.num_experts
        resident = [[] for _ in range(self.geometry.num_layers)]
        for rid in sorted(self.pool.slot_of):
            resident[rid // n].append(rid % n)
        self.stats.resident = resident
        snap = self.stats.snapshot()
        snap["pool"] = {"slots": self.pool.num_slots, "resident": self.pool.resident,
                        "ring_slots": self.pool.ring_slots, "stride": self.pool.stride, "precision": self.cfg.precision,
                        "miss_precision": self.miss_precision, "host_slots": self.host.capacity if self.host else 0}
        return snap

    def close(self) -> None:
        self.fetcher.close()
