"""Records read in place: preloading every record where it stays, and the address table that lets a
decode step run as one CUDA graph (kernels read GPU pool slots, or mapped pinned host-tier slots over
PCIe, with no host decision)."""

from __future__ import annotations

import torch


class GraphMode:
    """Mixed into StreamingProvider; uses its pool, host tier, fetcher and geometry."""

    def preload(self, on_progress=None) -> str | None:
        """Load every record of the base precision into the GPU pool if it holds them all, else into the host
        tier if it does, at the precision misses are fetched in; mixed mode then adds base-precision records
        (for pool fills and lookahead) while the tier has free slots. Returns where ("pool" or "host"), or None
        when neither holds the whole model."""
        g, total, base, miss = self.geometry, self.geometry.num_records, self.cfg.precision, self.miss_precision
        if self.pool.num_slots >= total:
            where = "pool"
        elif self.host is not None and self.host.capacity >= total:
            where = "host"
        else:
            return None
        futures = []
        for layer in range(g.num_layers):
            items = []  # pool slots for this layer's records (distinct: the pool holds the whole model)
            for e in range(g.num_experts):
                rid = g.rid(layer, e)
                if where == "pool" and self.pool.lookup(rid) is None:
                    items.append((rid, self.pool.allocate(rid)))
                elif where == "host" and self.host.lookup((miss, rid)) is None:
                    futures.append(self.fetcher.fill_host(rid, miss, layer))
            futures += self._fetch(layer, items, base) if items else []
            if on_progress:
                on_progress(layer + 1, g.num_layers)
        if where == "host" and miss != base:  # mixed mode: Q4 records in the free slots alone, evicting none
            free = self.host.capacity - len(self.host.slot_of)
            for rid in [rid for rid in range(total) if (base, rid) not in self.host.slot_of][:free]:
                futures.append(self.fetcher.fill_host(rid, base, rid // g.num_experts))
        for f in futures:
            f.result(timeout=self.cfg.io_timeout_s * max(1, len(futures) // 64))
        return where

    def address_table(self) -> torch.Tensor | None:
        """[num_layers, num_experts] int64 device addresses of every record (GPU pool slot, else pinned host-tier
        slot at the miss precision, as a demand miss would fetch it), or None when some record is in neither. A
        cached record is read at its own precision; mixed mode notes each one's in `addressed_low_bit`."""
        if not self.device.cuda:
            return None
        evictions = self.host.evictions if self.host else 0
        if self._table_state == "valid" and evictions != self._table_evictions:  # a host slot it named was reused
            self._table_state = None
        if self._table_state is None:
            self._table_state, self._table_evictions = "absent", evictions
            g, base, miss, stride = self.geometry, self.cfg.precision, self.miss_precision, self.pool.stride
            table, precisions = [], []
            for rid in range(g.num_records):
                slot = self.pool.slot_of.get(rid)
                if slot is not None:
                    table.append(self.pool.buffer.data_ptr() + slot * stride)
                    precisions.append(self.pool.precision_of[slot])
                    continue
                hslot = self.host.slot_of.get((miss, rid)) if self.host else None
                if hslot is None:
                    return None
                table.append(self.host.buffer.data_ptr() + hslot * self.host.stride)
                precisions.append(miss)
            for f in self.pool.pending + (self.host.last_job if self.host else []):
                if f is not None:
                    f.result(timeout=self.cfg.io_timeout_s)
            torch.cuda.synchronize(self.device.device)
            table = torch.tensor(table, dtype=torch.int64).view(g.num_layers, g.num_experts)
            if self._addresses is None:  # persistent, so a captured graph sees later rebuilds
                self._addresses = torch.empty_like(table, device=self.device.device)
                if miss != base:
                    self._record_bits = torch.empty(table.shape, dtype=torch.int32, device=self.device.device)
            self._addresses.copy_(table)
            if miss != base:
                bits = [self.layouts[p].bits for p in precisions]
                self._record_bits.copy_(torch.tensor(bits, dtype=torch.int32).view(table.shape))
            self._table_state = "valid"
        return self._addresses if self._table_state == "valid" else None

    def addressed_low_bit(self, layer: int) -> tuple | None:
        """Mixed mode: (the miss layout, layer `layer`'s record bits by expert id) for a step that reads records
        by address, whose kernels then run once per precision; None with one precision."""
        if self.miss_precision == self.cfg.precision:
            return None
        return self.layouts[self.miss_precision], self._record_bits[layer]

    def in_place_table(self, layer: int, rows: int) -> torch.Tensor | None:
        """Layer `layer`'s device addresses by expert id when a prefill step of `rows` reads every expert in place
        (`prefill_in_place`, the whole model in the pool at one precision), else None."""
        g = self.geometry
        if not (self.cfg.prefill_in_place and rows >= self.cfg.prefill_min_rows and self.pool.resident == g.num_records
                and self.miss_precision == self.cfg.precision):
            return None
        table = self.address_table()
        return None if table is None else table[layer]

    def count_in_place(self, layer: int, counts: torch.Tensor) -> None:
        """Note an in-place prefill step by its entries per expert (device), counted by `flush_addressed` as the
        ring path counts: each expert used is a lookup and a hit."""
        self.stats.at(layer, self.cfg.precision).prefill_steps += 1
        self._in_place.append((layer, counts))
        if len(self._in_place) >= 256:
            self.flush_addressed()

    def _flush_in_place(self) -> None:
        used = (torch.stack([c for _, c in self._in_place]) > 0).cpu().tolist()
        for (layer, _), row in zip(self._in_place, used):
            self._count_hits(layer, self.cfg.precision, sum(row))
            self._count_uses(layer, row)
        self._in_place = []

    def _count_hits(self, layer: int, precision: str, n: int) -> None:
        """`n` lookups that hit pool records of `precision`, each a pool read."""
        c = self.stats.at(layer, precision)
        c.lookups += n
        c.hits += n
        self.stats.read(layer, precision, "gpu", n * self.layouts[precision].stride, records=n)

    def _count_uses(self, layer: int, uses: list[int]) -> None:
        self.stats.expert_uses[layer] = [a + b for a, b in zip(self.stats.expert_uses[layer], uses)]

    def count_addressed(self, routed: torch.Tensor) -> None:
        """Note a decode step that read its records by address (a graph replay sees no provider): `routed`
        [num_layers, top_k] are its expert ids. Counted in bulk by `flush_addressed`, so the step never waits."""
        self._addressed.append(routed.clone())
        if len(self._addressed) >= 256:
            self.flush_addressed()

    def flush_addressed(self) -> None:
        """Count the noted steps against the current residency; runs before residency can change (the next
        provider step) and before the counters are read. A pool record is a hit; any other is a miss read in
        place from the host tier, as the address table points."""
        if self._in_place:
            self._flush_in_place()
        if not self._addressed:
            return
        ids = torch.stack(self._addressed).cpu().sort(-1).values  # [steps, layers, top_k]
        self._addressed = []
        g, base, miss = self.geometry, self.cfg.precision, self.miss_precision
        distinct = torch.ones_like(ids, dtype=torch.bool)
        distinct[..., 1:] = ids[..., 1:] != ids[..., :-1]
        rid = ids + torch.arange(g.num_layers)[None, :, None] * g.num_experts
        cached = {p: torch.zeros(g.num_records, dtype=torch.bool) for p in {base, miss}}
        for r, slot in self.pool.slot_of.items():
            precision = self.pool.precision_of[slot]  # None for a slot whose fill is not fetched yet
            if precision in cached:
                cached[precision][r] = True
        # as the host path counts: a hit at its record's precision; a miss at the base one, read at the miss one
        hits = {p: (distinct & c[rid]).sum((0, 2)).tolist() for p, c in cached.items()}
        lookups = distinct.sum((0, 2)).tolist()
        uses = torch.bincount(rid[distinct], minlength=g.num_records).view(g.num_layers, g.num_experts).tolist()
        for layer in range(g.num_layers):
            misses = lookups[layer] - sum(h[layer] for h in hits.values())
            c = self.stats.at(layer, base)
            c.decode_steps += ids.shape[0]
            c.lookups += misses
            c.misses += misses
            self.stats.read(layer, miss, "host", misses * self.layouts[miss].stride, records=misses)
            for p, h in hits.items():
                self._count_hits(layer, p, h[layer])
            self._count_uses(layer, uses[layer])
