"""The one seam between the MoE layers and the expert subsystem.

`batches(layer_slot, topk_ids, x)` yields `ExpertBatch`es of experts whose records are on the device (or
whose copies the compute stream already waits for). Two paths, with the same results:
- pool path (decode, few rows): hits compute at once; misses get pool slots (LRU, never evicting a slot
  this step uses) and fetches; then layer L+1's router on the current hidden state predicts L+1's
  experts, and their fetches start after L's misses (one-layer lookahead).
- ring path (prefill): the layer's most-used experts, up to the pool's per-layer share, are fetched into
  the pool and stay for decode; the rest stream through the ring in batches of `ring_group`, each
  ring slot reused only after the batch that last read it is done (the seed's two-event protocol).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from moestream.config import ExpertConfig
from moestream.errors import BudgetError
from moestream.experts.fetch import Fetcher
from moestream.experts.grouping import ExpertBatch, Grouping, batch_of, group_by_expert
from moestream.experts.host import HostTier
from moestream.experts.memory import Device
from moestream.experts.pool import ExpertPool
from moestream.experts.reads import RecordReader
from moestream.experts.store import Store
from moestream.stats.counters import ExpertStats


def pool_slots_for(store: Store, cfg: ExpertConfig, device: torch.device, top_k: int) -> int:
    """Pool size in records from `pool_gb`, or automatic from free memory; refuses a pool below one step."""
    layout = store.manifest.layouts[cfg.precision]
    total = store.manifest.geometry.num_records
    need = top_k
    if cfg.pool_gb is not None:
        slots = int(cfg.pool_gb * 1e9 // layout.stride)
        if slots < need:
            raise BudgetError(f"--pool-gb {cfg.pool_gb:g} holds {slots} expert records of {layout.stride / 1e6:.2f} "
                              f"MB; one decode step needs at least {need} ({need * layout.stride / 1e9:.3f} GB)")
        return min(slots, total)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        spare = free - max(2e9, 0.1 * free) - cfg.ring_slots * layout.stride  # KV, activations, scratch
    else:
        import os

        spare = 0.4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    slots = min(total, int(spare // layout.stride))
    if slots < need:
        raise BudgetError(f"only {max(spare, 0) / 1e9:.2f} GB is free for the expert pool; one decode step needs "
                          f"{need * layout.stride / 1e9:.3f} GB ({need} records)")
    return slots


class StreamingProvider:
    def __init__(self, store: Store, cfg: ExpertConfig, device: torch.device, top_k: int):
        self.cfg, self.geometry = cfg, store.manifest.geometry
        self.layout = store.manifest.layouts[cfg.precision]
        self.device = Device(device, cfg.io_timeout_s)
        self.stats = ExpertStats(self.geometry.num_layers, self.geometry.num_experts)
        stride = self.layout.stride
        self.pool = ExpertPool(pool_slots_for(store, cfg, device, top_k), cfg.ring_slots, stride, device)
        reader = RecordReader(store.experts_path(cfg.precision), stride, self.geometry.num_records, cfg.direct_io)
        self.stats.direct_io = reader.direct
        self.io_note = reader.fallback_reason
        host = None
        if cfg.host_gb > 0:
            host = HostTier(max(1, int(cfg.host_gb * 1e9 // stride)), stride, self.device.cuda)
        self.fetcher = Fetcher(self.device, {cfg.precision: reader}, host, self.stats, cfg.read_threads,
                               cfg.staging_records, cfg.fake_reads)
        self.routers: dict[int, torch.Tensor] = {}  # layer slot -> router weight, for lookahead
        self.host = host
        self._addresses: torch.Tensor | None = None  # persistent, so captured graphs see rebuilds
        self._table_state: str | None = None  # None = rebuild, "valid", or "absent"
        self._profiles: list[dict] = []
        self._current_profile: dict | None = None

    # -- the seam -------------------------------------------------------------------------------------
    def batches(self, layer_slot: int, topk_ids: torch.Tensor, x: torch.Tensor) -> Iterator[ExpertBatch]:
        g = group_by_expert(topk_ids)
        self.pool.new_step()
        if topk_ids.shape[0] >= self.cfg.prefill_min_rows or len(g.experts) > self.pool.num_slots:
            yield from self._ring_path(layer_slot, g)
        else:
            yield from self._pool_path(layer_slot, g, x)

    # -- decode ---------------------------------------------------------------------------------------
    def _pool_path(self, layer: int, g: Grouping, x: torch.Tensor) -> Iterator[ExpertBatch]:
        c = self.stats.at(layer, self.cfg.precision)
        c.decode_steps += 1
        hits, misses = [], []
        for j, e in enumerate(g.experts):
            rid = self.geometry.rid(layer, e)
            slot = self._lookup(layer, rid)
            (hits if slot is not None else misses).append((j, slot))
        fetches = []
        for i, (j, _) in enumerate(misses):
            rid = self.geometry.rid(layer, g.experts[j])
            slot = self.pool.allocate(rid)
            self.pool.pin(slot)
            misses[i] = (j, slot)
            fetches.append(self._fetch(layer, rid, slot))
        c.misses += len(misses)
        if self.cfg.lookahead:
            self._prefetch_next(layer, x)
        used = []
        for part, waits in ((hits, [self.pool.pending[s] for _, s in hits]), (misses, fetches)):
            if part:
                self._wait(layer, [s for _, s in part], waits)
                used += [s for _, s in part]
                yield batch_of(g, [j for j, _ in part], self.pool.buffer, self.layout, [s for _, s in part])
        self._done(used)

    def _lookup(self, layer: int, rid: int) -> int | None:
        c = self.stats.at(layer, self.cfg.precision)
        c.lookups += 1
        self.stats.expert_uses[layer][rid % self.geometry.num_experts] += 1
        slot = self.pool.lookup(rid)
        if slot is not None:
            c.hits += 1
            self.stats.read(layer, self.cfg.precision, "gpu", self.layout.stride)
            self.pool.pin(slot)
            if rid in self.pool.prefetched:
                self.pool.prefetched.discard(rid)
                c.prefetch_used += 1
        return slot

    def _prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        router = self.routers.get(layer + 1)
        if router is None:
            return
        top_k = min(self.geometry.num_experts, self._top_k)
        predicted = torch.topk(x @ router.T, top_k, dim=-1).indices.reshape(-1).unique().tolist()
        c = self.stats.at(layer + 1, self.cfg.precision)
        for e in predicted:
            rid = self.geometry.rid(layer + 1, e)
            if self.pool.lookup(rid) is not None:
                continue
            slot = self.pool.allocate(rid)
            if slot is None:
                break
            self.pool.prefetched.add(rid)
            self._fetch(layer + 1, rid, slot)
            c.prefetch_issued += 1

    # -- prefill --------------------------------------------------------------------------------------
    def _ring_path(self, layer: int, g: Grouping) -> Iterator[ExpertBatch]:
        c = self.stats.at(layer, self.cfg.precision)
        c.prefill_steps += 1
        prof = self._profile_begin(layer)
        share = self.pool.num_slots // self.geometry.num_layers
        ranked = sorted(range(len(g.experts)), key=lambda j: -g.counts[j])  # stable: ties keep expert order
        keep = set(ranked[:share])
        slots, waits, ring_jobs = [], [], []  # ring_jobs: (job index, rid, ring slot)
        for j, e in enumerate(g.experts):
            rid = self.geometry.rid(layer, e)
            slot = self._lookup(layer, rid)
            wait = self.pool.pending[slot] if slot is not None else None
            if slot is None:
                c.misses += 1
                slot = self.pool.allocate(rid) if j in keep else None
                if slot is not None:
                    self.pool.pin(slot)
                    wait = self._fetch(layer, rid, slot)
                else:
                    slot = self.pool.ring_slot(len(ring_jobs))
                    ring_jobs.append((j, rid, slot))
            slots.append(slot)
            waits.append(wait)
        group, ring = self.cfg.ring_group, self.pool.ring_slots
        batches = [list(range(i, min(i + group, len(slots)))) for i in range(0, len(slots), group)]
        batch_of_job = {j: b for b, idx in enumerate(batches) for j in idx}
        # A ring job reuses the slot of ring job r - RING; it may start once that job's batch is done.
        gate = [batch_of_job[ring_jobs[r - ring][0]] if r >= ring else -1 for r in range(len(ring_jobs))]
        submitted = 0

        def submit_ready(done_batch: int) -> None:
            nonlocal submitted
            while submitted < len(ring_jobs) and gate[submitted] <= done_batch:
                j, rid, slot = ring_jobs[submitted]
                waits[j] = self._fetch(layer, rid, slot, ring=True)
                submitted += 1

        submit_ready(-1)
        for b, idx in enumerate(batches):
            self._wait(layer, [slots[j] for j in idx], [waits[j] for j in idx])
            begin = self._mark(prof)
            yield batch_of(g, idx, self.pool.buffer, self.layout, [slots[j] for j in idx])
            if prof is not None:
                prof["compute"].append((begin, self._mark(prof)))
            self._done([slots[j] for j in idx])
            submit_ready(b)
        if prof is not None:
            prof["end"] = self._mark(prof)
            self._current_profile = None

    # -- graph mode -----------------------------------------------------------------------------------
    def preload(self, on_progress=None) -> str | None:
        """Load every record where it will stay: the GPU pool if it holds them all, else the host tier if it
        does. Returns where ("pool" or "host"), or None when neither holds the whole model."""
        g, total = self.geometry, self.geometry.num_records
        if self.pool.num_slots >= total:
            where = "pool"
        elif self.host is not None and self.host.capacity >= total:
            where = "host"
        else:
            return None
        futures = []
        for layer in range(g.num_layers):
            for e in range(g.num_experts):
                rid = g.rid(layer, e)
                if where == "pool" and self.pool.lookup(rid) is None:
                    futures.append(self._fetch(layer, rid, self.pool.allocate(rid)))
                elif where == "host" and self.host.lookup(rid) is None:
                    futures.append(self.fetcher.fill_host(rid, self.cfg.precision, layer))
            if on_progress:
                on_progress(layer + 1, g.num_layers)
        for f in futures:
            f.result(timeout=self.cfg.io_timeout_s * max(1, len(futures) // 64))
        return where

    def address_table(self) -> torch.Tensor | None:
        """[num_layers, num_experts] int64 device addresses of every record (GPU pool slot, else mapped
        pinned host-tier slot), or None when some record is in neither. Kernels read records in place."""
        if not self.device.cuda:
            return None
        if self._table_state is None:
            self._table_state = "absent"
            g, stride = self.geometry, self.layout.stride
            table = []
            for rid in range(g.num_records):
                slot = self.pool.slot_of.get(rid)
                if slot is not None:
                    table.append(self.pool.buffer.data_ptr() + slot * stride)
                    continue
                hslot = self.host.slot_of.get(rid) if self.host else None
                if hslot is None:
                    return None
                table.append(self.host.buffer.data_ptr() + hslot * self.host.stride)
            for f in self.pool.pending + (self.host.last_job if self.host else []):
                if f is not None:
                    f.result(timeout=self.cfg.io_timeout_s)
            torch.cuda.synchronize(self.device.device)
            table = torch.tensor(table, dtype=torch.int64).view(g.num_layers, g.num_experts)
            if self._addresses is None:
                self._addresses = torch.empty_like(table, device=self.device.device)
            self._addresses.copy_(table)
            self._table_state = "valid"
        return self._addresses if self._table_state == "valid" else None

    # -- profiling (CUDA events, resolved when the stats are read) -------------------------------------
    def _profile_begin(self, layer: int) -> dict | None:
        if not (self.cfg.profile and self.device.cuda):
            return None
        prof = {"layer": layer, "copies": [], "compute": []}
        prof["start"] = self._mark(prof)
        self._profiles.append(prof)
        self._current_profile = prof
        return prof

    def _mark(self, prof):
        if prof is None:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve_profiles(self) -> list[dict]:
        """Per profiled prefill layer: seconds of copies (copy stream busy), compute, and wall."""
        if not self._profiles:
            return self.stats.timings
        torch.cuda.synchronize(self.device.device)
        for p in self._profiles:
            copy = sum(a.elapsed_time(b) for a, b in p["copies"]) / 1e3
            compute = sum(a.elapsed_time(b) for a, b in p["compute"]) / 1e3
            wall = p["start"].elapsed_time(p["end"]) / 1e3
            self.stats.timings.append({"layer": p["layer"], "copy_s": copy, "compute_s": compute, "wall_s": wall,
                                       "copies": len(p["copies"])})
        self._profiles, self._current_profile = [], None
        return self.stats.timings

    # -- plumbing -------------------------------------------------------------------------------------
    def _fetch(self, layer: int, rid: int, slot: int, ring: bool = False):
        if not ring:
            self._table_state = None  # residency changes: graph-mode addresses must be rebuilt
        prof = self._current_profile if self.cfg.profile and self.device.cuda else None
        ready = self.device.event(timing=prof is not None)
        started = self.device.event(timing=True) if prof is not None else None
        if prof is not None:
            prof["copies"].append((started, ready))
        future = self.fetcher.fetch(rid, self.cfg.precision, layer, self.pool.buffer[slot], self.pool.last_use[slot],
                                    self.pool.pending[slot], ready, started)
        self.pool.pending[slot], self.pool.ready[slot] = future, ready
        if ring:
            self.pool.rid_of[slot] = rid
        return future

    def _wait(self, layer: int, slots: list[int], futures: list) -> None:
        """Block until the fetches are enqueued, then make the compute stream wait for their copies."""
        start = time.perf_counter()
        for f in futures:
            if f is not None:
                f.result(timeout=self.cfg.io_timeout_s)
        waited = time.perf_counter() - start
        if waited > 1e-4:
            self.stats.at(layer, self.cfg.precision).io_wait_seconds += waited
        for s in slots:
            self.device.wait_on_compute(self.pool.ready[s])

    def _done(self, slots: list[int]) -> None:
        done = self.device.event()
        done.record(self.device.compute_stream())
        for s in slots:
            self.pool.last_use[s] = done

    def snapshot(self) -> dict:
        """The counters, with which experts of each layer are resident in the GPU pool right now."""
        n = self.geometry.num_experts
        resident = [[] for _ in range(self.geometry.num_layers)]
        for rid in sorted(self.pool.slot_of):
            resident[rid // n].append(rid % n)
        self.stats.resident = resident
        snap = self.stats.snapshot()
        snap["pool"] = {"slots": self.pool.num_slots, "resident": self.pool.resident,
                        "ring_slots": self.pool.ring_slots, "stride": self.layout.stride,
                        "precision": self.cfg.precision, "host_slots": self.host.capacity if self.host else 0}
        return snap

    def attach(self, routers: dict[int, torch.Tensor], top_k: int) -> None:
        self.routers, self._top_k = routers, top_k

    def close(self) -> None:
        self.fetcher.close()
