"""The one seam between the MoE layers and the expert subsystem.

`batches(layer_slot, topk_ids, x)` yields `ExpertBatch`es of experts whose records are on the device (or
whose copies the compute stream already waits for). Two paths, with the same results:
- pool path (decode, few rows): hits compute at once; misses get pool slots (LRU, never evicting a slot
  this step uses) and fetches; then layer L+1's router on the current hidden state predicts L+1's
  experts, and their fetches start after L's misses (one-layer lookahead).
- ring path (prefill, experts/ring.py): the layer's most-used experts, up to the pool's per-layer share, are
  fetched into the pool and stay for decode; the rest stream through the ring in batches of `ring_group`, each
  ring slot reused only after the batch that last read it is done (the seed's two-event protocol); a long
  prompt's next layer starts its ring fetches before its routing is known.
Mixed mode (`miss_precision`): demand and ring misses are fetched at Q3/Q2, pool fills and lookahead at
Q4 (at Q3/Q2 when the host tier holds only that record, rather than wait on the disk), and a cached record keeps
its precision; a batch holds one precision.
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
from moestream.experts.ring import RingPath
from moestream.experts.store import Store
from moestream.stats.counters import ExpertStats


class StreamingProvider(GraphMode, RingPath):
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
        self._addresses, self._record_bits, self._table_state = None, None, None  # graph mode (graphmode.py)
        self._table_evictions = 0
        self._addressed: list[torch.Tensor] = []  # expert ids of graph-mode steps not counted yet
        self._in_place: list[tuple[int, torch.Tensor]] = []  # (layer, entries per expert) of in-place prefills

    def attach(self, routers: dict[int, torch.Tensor]) -> None:
        self.routers = routers

    # -- the seam -------------------------------------------------------------------------------------
    def batches(self, layer_slot: int, topk_ids: torch.Tensor, x: torch.Tensor) -> Iterator[ExpertBatch]:
        self.flush_addressed()  # count earlier graph steps before this step changes residency
        g = group_by_expert(topk_ids, self.geometry.num_experts)
        self.pool.new_step()
        speculated, self._speculated = self._speculated, None  # good for the next layer's ring step only
        if topk_ids.shape[0] >= self.cfg.prefill_min_rows or len(g.experts) > self.pool.num_slots:
            yield from self._ring_path(layer_slot, g, speculated[1] if speculated and speculated[0] == layer_slot
                                       else {})
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
            self._fetch(layer + 1, [(rid, slot)], self._fill_precision(rid))
            c.prefetch_issued += 1

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

    def _fill_precision(self, rid: int) -> str:
        """Pool fills and lookahead fetch the base precision, unless the host tier holds only the miss precision's
        record (mixed mode with RAM for its misses alone): then that one, rather than wait on the disk."""
        base, miss, host = self.cfg.precision, self.miss_precision, self.host
        if miss != base and host is not None and (base, rid) not in host.slot_of and (miss, rid) in host.slot_of:
            return miss
        return base

    def _by_precision(self, jobs: list) -> list[tuple[str, list]]:
        groups: dict[str, list] = {}
        for job in jobs:
            groups.setdefault(self.pool.precision_of[job[1]], []).append(job)
        return sorted(groups.items(), key=lambda kv: kv[0] != self.cfg.precision)

    def _fetch(self, layer: int, items: list[tuple[int, int]], precision: str, ring: bool = False,
               early: bool = False) -> list:
        """Fetch records into distinct slots, `items` = [(record id, slot)]; one future per item. `early`: for
        the next layer, before its step (timed as its copies)."""
        if not ring:
            self._table_state = None  # residency changes: graph-mode addresses must be rebuilt
        requests = [FetchRequest(rid, precision, layer, self.pool.views[slot], self.pool.last_use[slot],
                                 self.pool.pending[slot]) for rid, slot in items]
        fetched = self.fetcher.fetch(requests, lambda: self._copy_events(early))
        for (rid, slot), (future, ready) in zip(items, fetched):
            self.pool.pending[slot], self.pool.ready[slot], self.pool.precision_of[slot] = future, ready, precision
            if ring:
                self.pool.rid_of[slot] = rid
        return [future for future, _ in fetched]

    def _copy_events(self, early: bool = False) -> tuple:
        """(started, ready) for a copy or a run of copies; `started` only when profiling."""
        started, ready = self.profiler.copy_events(self.device, early)
        return started, ready or self.device.event()

    def _wait(self, layer: int, slots: list[int], futures: list) -> None:
        """Block until the fetches are enqueued, then make the compute stream wait for their copies."""
        start = time.perf_counter()
        for s, f in zip(slots, futures):
            if f is not None:
                f.result(timeout=self.cfg.io_timeout_s)
                if self.pool.pending[s] is f:  # settled: later steps skip it (a resident's hit needs no future)
                    self.pool.pending[s] = None
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
