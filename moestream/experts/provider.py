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
        self.stats = ExpertStats(self.geometry.num_layers)
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
            yield batch_of(g, idx, self.pool.buffer, self.layout, [slots[j] for j in idx])
            self._done([slots[j] for j in idx])
            submit_ready(b)

    # -- plumbing -------------------------------------------------------------------------------------
    def _fetch(self, layer: int, rid: int, slot: int, ring: bool = False):
        ready = self.device.event()
        future = self.fetcher.fetch(rid, self.cfg.precision, layer, self.pool.buffer[slot], self.pool.last_use[slot],
                                    self.pool.pending[slot], ready)
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

    def attach(self, routers: dict[int, torch.Tensor], top_k: int) -> None:
        self.routers, self._top_k = routers, top_k

    def close(self) -> None:
        self.fetcher.close()
