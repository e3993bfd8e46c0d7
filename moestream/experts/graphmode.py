"""Records read in place: preloading every record where it stays, and the address table that lets a
decode step run as one CUDA graph (kernels read GPU pool slots, or mapped pinned host-tier slots over
PCIe, with no host decision)."""

from __future__ import annotations

import torch


class GraphMode:
    """Mixed into StreamingProvider; uses its pool, host tier, fetcher and geometry."""

    def preload(self, on_progress=None) -> str | None:
        """Load every record of the base precision into the GPU pool if it holds them all, else into the host
        tier if it does. Returns where ("pool" or "host"), or None when neither holds the whole model."""
        g, total, precision = self.geometry, self.geometry.num_records, self.cfg.precision
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
                    futures.append(self._fetch(layer, rid, self.pool.allocate(rid), precision))
                elif where == "host" and self.host.lookup((precision, rid)) is None:
                    futures.append(self.fetcher.fill_host(rid, precision, layer))
            if on_progress:
                on_progress(layer + 1, g.num_layers)
        for f in futures:
            f.result(timeout=self.cfg.io_timeout_s * max(1, len(futures) // 64))
        return where

    def address_table(self) -> torch.Tensor | None:
        """[num_layers, num_experts] int64 device addresses of every record in the base precision (GPU pool
        slot, else pinned host-tier slot), or None when some record is in neither."""
        if not self.device.cuda:
            return None
        if self._table_state is None:
            self._table_state = "absent"
            g, precision, stride = self.geometry, self.cfg.precision, self.pool.stride
            table = []
            for rid in range(g.num_records):
                slot = self.pool.slot_of.get(rid)
                if slot is not None and self.pool.precision_of[slot] == precision:
                    table.append(self.pool.buffer.data_ptr() + slot * stride)
                    continue
                hslot = self.host.slot_of.get((precision, rid)) if self.host else None
                if hslot is None:
                    return None
                table.append(self.host.buffer.data_ptr() + hslot * self.host.stride)
            for f in self.pool.pending + (self.host.last_job if self.host else []):
                if f is not None:
                    f.result(timeout=self.cfg.io_timeout_s)
            torch.cuda.synchronize(self.device.device)
            table = torch.tensor(table, dtype=torch.int64).view(g.num_layers, g.num_experts)
            if self._addresses is None:  # persistent, so a captured graph sees later rebuilds
                self._addresses = torch.empty_like(table, device=self.device.device)
            self._addresses.copy_(table)
            self._table_state = "valid"
        return self._addresses if self._table_state == "valid" else None

    def count_addressed(self, routed: torch.Tensor) -> None:
        """Count a decode step that read its records by address (a graph replay sees no provider): `routed`
        [num_layers, top_k] are the step's expert ids. A pool record is a hit; any other is a miss read in
        place from the host tier, as the address table points."""
        precision, n = self.cfg.precision, self.geometry.num_experts
        stride = self.layouts[precision].stride
        for layer, experts in enumerate(routed.tolist()):
            c = self.stats.at(layer, precision)
            c.decode_steps += 1
            for e in sorted(set(experts)):
                rid = self.geometry.rid(layer, e)
                slot = self.pool.slot_of.get(rid)
                hit = slot is not None and self.pool.precision_of[slot] == precision
                c.lookups += 1
                c.hits += hit
                c.misses += not hit
                self.stats.expert_uses[layer][rid % n] += 1
                self.stats.read(layer, precision, "gpu" if hit else "host", stride)
