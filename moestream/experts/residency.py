"""Where expert records are: the GPU pool, the pinned host tier and the fetches between them, and the one place
that counts what each step found.

A lookup is counted when a step asks for its records (`lookups`), or in bulk for steps that read their records by
address with no host decision (`note_addressed`, counted by `flush` against the residency they ran with). Fetches
fill pool or ring slots on the copy stream; each slot remembers the fetch filling it and the compute event after
its last reader (pool.py), so a copy never lands in a slot a kernel may still read, nor a kernel reads before it.
Mixed mode (`miss_precision`): a cached record keeps its precision, and a hit or a miss is counted at it.
"""

from __future__ import annotations

import time
from concurrent import futures

import torch

from moestream.config import ExpertConfig
from moestream.experts.budget import pool_slots_for
from moestream.experts.fetch import Fetcher, FetchRequest
from moestream.experts.host import HostTier
from moestream.experts.memory import Device
from moestream.experts.pool import ExpertPool
from moestream.experts.profile import Profiler
from moestream.experts.reads import RecordReader
from moestream.experts.store import Store
from moestream.stats.counters import ExpertStats


class Residency:
    def __init__(self, store: Store, cfg: ExpertConfig, device: torch.device, top_k: int, reserved: int = 0):
        self.cfg, self.geometry, self.top_k = cfg, store.manifest.geometry, top_k
        self.base = cfg.precision or store.default_precision
        self.miss = cfg.miss_precision or self.base
        self.layouts = {p: store.manifest.layouts[p] for p in {self.base, self.miss}}
        stride = max(layout.stride for layout in self.layouts.values())
        self.device = Device(device, cfg.io_timeout_s)
        self.stats = ExpertStats(self.geometry.num_layers, self.geometry.num_experts)
        self.pool = ExpertPool(pool_slots_for(store, cfg, device, top_k, stride, reserved), cfg.ring_slots, stride,
                               device)
        readers = {p: RecordReader(store.experts_path(p), layout.stride, self.geometry.num_records, cfg.direct_io)
                   for p, layout in self.layouts.items()}
        self.stats.direct_io = all(r.direct for r in readers.values())
        self.io_note = next((r.fallback_reason for r in readers.values() if r.fallback_reason), None)
        host_slots = max(1, int(cfg.host_gb * 1e9 // stride))
        self.host = HostTier(host_slots, stride, self.device.cuda) if cfg.host_gb else None
        self.fetcher = Fetcher(self.device, readers, self.host, self.stats, cfg.read_threads, cfg.staging_records,
                               cfg.fake_reads)
        self.profiler = Profiler(cfg.profile and self.device.cuda)
        self.changed = True  # pool residency changed since the address table was built (addresses.py)
        self._addressed: list[torch.Tensor] = []  # expert ids of steps read by address, not counted yet
        self._placed_uses: torch.Tensor | None = None  # [layers, experts] int32 (device): placed steps' uses
        self._placed = False  # whether it holds uses not counted yet
        self.trace = None  # a stats.trace.RoutingTrace while routing is recorded (the provider's `trace`)

    # -- counting -------------------------------------------------------------------------------------
    def lookups(self, layer: int, rids: list[int]) -> list[int | None]:
        """Each record's pool slot (a hit, pinned for this step) or None (a miss), counted once for all of them (a
        resident prefill layer's host work keeps the GPU waiting: counting 128 lookups one by one was most of it)."""
        pool, uses, n = self.pool, self.stats.expert_uses[layer], self.geometry.num_experts
        slots, hits, precision_of, prefetched = pool.lookup_many(rids), {}, pool.precision_of, pool.prefetched
        for rid, slot in zip(rids, slots):
            uses[rid % n] += 1
            if slot is None:
                continue
            precision = precision_of[slot]
            hits[precision] = hits.get(precision, 0) + 1
            if rid in prefetched:
                prefetched.discard(rid)
                self.stats.at(layer, precision).prefetch_used += 1
        pool.pinned.update(s for s in slots if s is not None)
        for precision, count in hits.items():
            self._count_hits(layer, precision, count)
        if misses := len(rids) - sum(hits.values()):
            self._count_misses(layer, misses)
        return slots

    def _count_hits(self, layer: int, precision: str, n: int) -> None:
        """`n` lookups that hit pool records of `precision`, each a pool read."""
        c = self.stats.at(layer, precision)
        c.lookups += n
        c.hits += n
        self.stats.read(layer, precision, "gpu", n * self.layouts[precision].stride, records=n)

    def _count_misses(self, layer: int, n: int) -> None:
        """`n` lookups that missed the pool, counted at the base precision."""
        c = self.stats.at(layer, self.base)
        c.lookups += n
        c.misses += n

    def note_addressed(self, routed: torch.Tensor) -> None:
        """A decode step that read its records by address (a graph replay sees no provider): `routed`
        [num_layers, rows * top_k] are its expert ids (-1 in a layer it did not run: the MTP head's in a trunk
        step, the trunk's in a head step), counted in bulk by `flush`, so the step never waits."""
        self._addressed.append(routed.clone())
        if len(self._addressed) >= 256:
            self.flush()

    def placed_uses(self, layer: int) -> torch.Tensor:
        """Where a placed prefill step of `layer` (every record in the pool, grouped on the device: PlacedExperts)
        adds 1 for each expert it uses, counted by `flush` as the ring counts a resident step."""
        if self._placed_uses is None:
            g = self.geometry
            self._placed_uses = torch.zeros(g.num_layers, g.num_experts, dtype=torch.int32, device=self.device.device)
        self.note_placed(layer)
        return self._placed_uses[layer]

    def note_placed(self, layer: int) -> None:
        """A placed prefill step of `layer` ran (a replayed graph's too): its uses are counted at the next flush."""
        self.stats.at(layer, self.base).prefill_steps += 1
        self._placed = True

    def flush(self) -> None:
        """Count the noted steps against the current residency: before it can change and before the counters are
        read. A step looks each expert up once for all of its rows (the union); a pool record is a hit, any other
        a miss read in place from the host tier, as the table points."""
        if self._placed:
            self._count_placed()
        noted, self._addressed = self._addressed, []
        if self.host is not None and any(r.shape[1] > self.top_k for r in noted):
            # batched steps staged host records in the ring's slots (AddressTable.staging): copies wait for them
            self.done(range(self.pool.num_slots, self.pool.num_slots + self.pool.ring_slots))
        runs: list[list[torch.Tensor]] = []  # consecutive steps of one row count, in step order
        for routed in noted:
            if runs and runs[-1][0].shape[1] == routed.shape[1]:
                runs[-1].append(routed)
            else:
                runs.append([routed])
        for run in runs:
            self._count_addressed(torch.stack(run, 1).cpu().transpose(0, 1))

    @torch.inference_mode()  # the uses were made in a forward: an inference tensor
    def _count_placed(self) -> None:
        """Placed prefill steps: every expert used was a lookup and a pool hit at the base precision."""
        uses = self._placed_uses.tolist()
        self._placed_uses.zero_()
        self._placed = False
        for layer, used in enumerate(uses):
            if n := sum(used):
                self._count_hits(layer, self.base, n)
                self.stats.expert_uses[layer] = [a + b for a, b in zip(self.stats.expert_uses[layer], used)]

    def _count_addressed(self, ids: torch.Tensor) -> None:
        """ids [steps, layers, rows * top_k]."""
        ran = ids[..., 0] >= 0  # [steps, layers]
        if self.trace is not None:  # in step order: a host step flushes these before it runs
            for step, layers_ran in zip(ids.tolist(), ran.tolist()):
                for layer, experts in enumerate(step):
                    if layers_ran[layer]:
                        for row in range(0, len(experts), self.top_k):
                            self.trace.step(layer, [experts[row: row + self.top_k]])
        ids = ids.sort(-1).values
        g, routed_layers = self.geometry, ids.shape[1]
        distinct = ran[..., None].expand_as(ids).clone()
        distinct[..., 1:] &= ids[..., 1:] != ids[..., :-1]
        rid = ids.clamp(min=0) + torch.arange(routed_layers)[None, :, None] * g.num_experts
        hits = {p: (distinct & c[rid]).sum((0, 2)).tolist() for p, c in self._cached().items()}
        lookups = distinct.sum((0, 2)).tolist()
        uses = torch.bincount(rid[distinct], minlength=g.num_records).view(g.num_layers, g.num_experts).tolist()
        steps = ran.sum(0).tolist()
        for layer in range(routed_layers):
            if not steps[layer]:
                continue
            misses = lookups[layer] - sum(h[layer] for h in hits.values())
            self.stats.at(layer, self.base).decode_steps += steps[layer]
            for p, h in hits.items():
                self._count_hits(layer, p, h[layer])
            self._count_misses(layer, misses)
            self.stats.read(layer, self.miss, "host", misses * self.layouts[self.miss].stride, records=misses)
            self.stats.expert_uses[layer] = [a + b for a, b in zip(self.stats.expert_uses[layer], uses[layer])]

    def _cached(self) -> dict[str, torch.Tensor]:
        """Per precision, which records the pool holds [num_records] (a slot whose fill is not fetched yet has none).
        Built at once: one index assignment a record took ~14 ms a flush with the 30B's 6,144 records resident."""
        pool = self.pool
        rids = torch.tensor(list(pool.slot_of), dtype=torch.long)
        precisions = [pool.precision_of[slot] for slot in pool.slot_of.values()]
        cached = {}
        for p in self.layouts:
            cached[p] = torch.zeros(self.geometry.num_records, dtype=torch.bool)
            cached[p][rids[torch.tensor([q == p for q in precisions], dtype=torch.bool)]] = True
        return cached

    # -- fetching -------------------------------------------------------------------------------------
    def fill_precision(self, rid: int) -> str:
        """Pool fills and lookahead fetch the base precision, unless the host tier holds only the miss precision's
        record (mixed mode with RAM for its misses alone): then that one, rather than wait on the disk."""
        host = self.host
        if self.miss != self.base and host is not None and (self.base, rid) not in host.slot_of \
                and (self.miss, rid) in host.slot_of:
            return self.miss
        return self.base

    def by_precision(self, jobs: list) -> list[tuple[str, list]]:
        """Jobs (expert index, slot, wait) grouped by their slot's precision, the base one first."""
        groups: dict[str, list] = {}
        for job in jobs:
            groups.setdefault(self.pool.precision_of[job[1]], []).append(job)
        return sorted(groups.items(), key=lambda kv: kv[0] != self.base)

    def fetch(self, layer: int, items: list[tuple[int, int]], precision: str, ring: bool = False,
              early: bool = False) -> list:
        """Fetch records into distinct slots, `items` = [(record id, slot)]; one future per item. `early`: for
        the next layer, before its step (timed as its copies)."""
        if not ring:
            self.changed = True
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

    def wait(self, layer: int, slots: list[int], futures: list) -> None:
        """Block until the fetches are enqueued, then make the compute stream wait for their copies."""
        start = time.perf_counter()
        for s, f in zip(slots, futures):
            if f is not None:
                self._result(s, f)
                if self.pool.pending[s] is f:  # settled: later steps skip it (a resident's hit needs no future)
                    self.pool.pending[s] = None
        waited = time.perf_counter() - start
        if waited > 1e-4:
            self.stats.at(layer, self.base).io_wait_seconds += waited
        waited_on = None
        for s in slots:
            ready = self.pool.ready[s]
            if ready is not None:  # once waited on, later compute is ordered after the copy
                if ready is not waited_on:  # a run of copies shares one event
                    self.device.wait_on_compute(ready)
                    waited_on = ready
                self.pool.ready[s] = None

    def done(self, slots: list[int]) -> None:
        """The slots' readers are enqueued: a later copy into them waits for this event."""
        done = self.device.event()
        done.record(self.device.compute_stream())
        for s in slots:
            self.pool.last_use[s] = done

    def _result(self, slot: int, future) -> None:
        """Wait for a slot's fetch. A failure leaves every slot whose fetch failed empty, so that no later step
        meets the error again (the file may be mended; the next use fetches afresh)."""
        try:
            future.result(timeout=self.cfg.io_timeout_s)
        except BaseException:
            pending = [(s, f) for s, f in enumerate(self.pool.pending) if f is not None]
            futures.wait([f for _, f in pending], timeout=self.cfg.io_timeout_s)  # the step's other fetches too
            for s, f in pending:
                if f is future or (f.done() and f.exception() is not None):
                    self.pool.forget(s)
            raise

    def settle(self) -> None:
        """Wait for every fetch in flight and every copy on the device (before addresses are handed out)."""
        for slot, f in enumerate(self.pool.pending):
            if f is not None:
                self._result(slot, f)
        for f in self.host.last_job if self.host else []:
            if f is not None:
                f.result(timeout=self.cfg.io_timeout_s)
        if self.device.cuda:
            torch.cuda.synchronize(self.device.device)

    def resident(self) -> list[list[int]]:
        """Each layer's experts in the GPU pool right now."""
        n = self.geometry.num_experts
        out = [[] for _ in range(self.geometry.num_layers)]
        for rid in sorted(self.pool.slot_of):
            out[rid // n].append(rid % n)
        return out

    def close(self) -> None:
        self.fetcher.close()
