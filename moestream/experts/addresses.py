"""Records read in place: preloading every record where it stays, and the address table that lets a decode step
run as one CUDA graph (kernels read GPU pool slots, or mapped pinned host-tier slots over PCIe, with no host
decision)."""

from __future__ import annotations

import torch

from moestream.experts.grouping import HostStaging
from moestream.experts.residency import Residency


class AddressTable:
    def __init__(self, residency: Residency, keep: list[bool] | None = None):
        """`keep`: by expert id, the experts this rank holds (experts/sharding.py); None: all of them."""
        self.res, self.keep = residency, keep
        self.addresses, self.record_bits = None, None  # persistent: a captured graph sees every rebuild
        self.valid, self.host_evictions = False, 0
        self._staging = None

    def preload(self, on_progress=None) -> str | None:
        """Load every record of the base precision into the GPU pool if it holds them all, else into the host
        tier if it does, at the precision misses are fetched in; mixed mode then adds base-precision records
        (for pool fills and lookahead) while the tier has free slots. Returns where ("pool" or "host"), or None
        when neither holds the whole model."""
        res = self.res
        g, pool, host = res.geometry, res.pool, res.host
        experts = [e for e in range(g.num_experts) if self.keep is None or self.keep[e]]
        total = g.num_layers * len(experts)
        if pool.num_slots >= total:
            where = "pool"
        elif host is not None and host.capacity >= total:
            where = "host"
        else:
            return None
        futures = []
        for layer in range(g.num_layers):
            items = []  # pool slots for this layer's records (distinct: the pool holds the whole model)
            for e in experts:
                rid = g.rid(layer, e)
                if where == "pool" and pool.lookup(rid) is None:
                    items.append((rid, pool.allocate(rid)))
                elif where == "host" and host.lookup((res.miss, rid)) is None:
                    futures.append(res.fetcher.fill_host(rid, res.miss, layer))
            futures += res.fetch(layer, items, res.base) if items else []
            if on_progress:
                on_progress(layer + 1, g.num_layers)
        if where == "host" and res.miss != res.base:  # mixed mode: Q4 records in the free slots alone, evicting none
            free = host.capacity - len(host.slot_of)
            records = [g.rid(layer, e) for layer in range(g.num_layers) for e in experts]
            for rid in [rid for rid in records if (res.base, rid) not in host.slot_of][:free]:
                futures.append(res.fetcher.fill_host(rid, res.base, rid // g.num_experts))
        for f in futures:
            f.result(timeout=res.cfg.io_timeout_s * max(1, len(futures) // 64))
        return where

    def table(self) -> torch.Tensor | None:
        """[num_layers, num_experts] int64 device addresses of every record (GPU pool slot, else pinned host-tier
        slot at the miss precision, as a demand miss would fetch it), or None when some record is in neither. A
        cached record is read at its own precision; mixed mode notes each one's in `low_bit`."""
        res = self.res
        if not res.device.cuda:
            return None
        evictions = res.host.evictions if res.host else 0
        if res.changed or evictions != self.host_evictions:  # a slot it named was refilled
            res.changed, self.host_evictions = False, evictions
            self.valid = self._build()
        return self.addresses if self.valid else None

    def placed(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s device addresses by expert id when every record of the model is in the GPU pool at one
        precision, landed (a prefill step then groups its entries on the device), else None."""
        res = self.res
        if res.pool.resident < res.geometry.num_records or res.miss != res.base:
            return None
        table = self.table()
        return None if table is None else table[layer]

    def _build(self) -> bool:
        res = self.res
        g, pool, host, stride = res.geometry, res.pool, res.host, res.pool.stride
        table, precisions = [], []
        for rid in range(g.num_records):
            slot = pool.slot_of.get(rid)
            if slot is not None:
                table.append(pool.buffer.data_ptr() + slot * stride)
                precisions.append(pool.precision_of[slot])
                continue
            hslot = host.slot_of.get((res.miss, rid)) if host else None
            if hslot is None:
                return False
            table.append(host.buffer.data_ptr() + hslot * host.stride)
            precisions.append(res.miss)
        res.settle()
        table = torch.tensor(table, dtype=torch.int64).view(g.num_layers, g.num_experts)
        if self.addresses is None:
            with torch.inference_mode(False):  # the table outlives the step that first builds it; later ones write it
                self.addresses = torch.empty_like(table, device=res.device.device)
                if res.miss != res.base:
                    self.record_bits = torch.empty(table.shape, dtype=torch.int32, device=res.device.device)
        self.addresses.copy_(table)
        if res.miss != res.base:
            bits = [res.layouts[p].bits for p in precisions]
            self.record_bits.copy_(torch.tensor(bits, dtype=torch.int32).view(table.shape))
        return True

    def staging(self) -> HostStaging | None:
        """Where a step of several rows stages its host-tier records (None without a host tier): the ring's device
        slots, which no addressed step otherwise uses; `Residency.flush` orders later ring copies after it."""
        res = self.res
        if res.host is None:
            return None
        if self._staging is None:
            pool, host, device = res.pool, res.host, res.device.device
            capacity = 1 << (pool.ring_slots.bit_length() - 1)  # a power of two: the plan kernel's width
            self._staging = HostStaging(
                host.buffer.data_ptr(), host.buffer.data_ptr() + host.buffer.numel(),
                pool.buffer[pool.num_slots:pool.num_slots + capacity], res.layouts[res.miss].stride,
                torch.empty(res.geometry.num_experts, dtype=torch.int64, device=device),
                torch.empty(capacity, dtype=torch.int64, device=device))
        return self._staging

    def low_bit(self, layer: int) -> tuple | None:
        """Mixed mode: (the miss layout, layer `layer`'s record bits by expert id) for a step that reads records
        by address, whose kernels then run once per precision; None with one precision."""
        res = self.res
        if res.miss == res.base:
            return None
        return res.layouts[res.miss], self.record_bits[layer]
