"""The GPU pool: one device buffer of record slots and the residency table record -> slot.

Slots [0, num_slots) are the pool, kept LRU and never evicted while used by the current step; slots
[num_slots, num_slots + ring_slots) are the prefill ring. Each slot remembers the fetch that is filling
it (`pending` and its copy's `ready` event: each None once waited on) and the compute event after its
last reader (`last_use`), so a copy never lands in a slot that a kernel may still read, and a kernel never
reads a slot before its copy.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import Future

import torch


class ExpertPool:
    def __init__(self, num_slots: int, ring_slots: int, stride: int, device: torch.device):
        self.num_slots, self.ring_slots, self.stride = num_slots, ring_slots, stride
        self.buffer = torch.empty(num_slots + ring_slots, stride, dtype=torch.uint8, device=device)
        self.views = list(self.buffer.unbind())  # one view per slot, made once (the prefill ring asks often)
        total = num_slots + ring_slots
        self.slot_of: dict[int, int] = {}
        self.rid_of: list[int | None] = [None] * total
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # oldest first
        self.pinned: set[int] = set()
        self.prefetched: set[int] = set()  # records fetched by lookahead and not used yet
        self.precision_of: list[str | None] = [None] * total  # a record keeps its precision while cached
        self.pending: list[Future | None] = [None] * total
        self.ready: list = [None] * total
        self.last_use: list = [None] * total

    def new_step(self) -> None:
        self.pinned.clear()

    def lookup(self, rid: int) -> int | None:
        slot = self.slot_of.get(rid)
        if slot is not None:
            self.lru.move_to_end(slot)
        return slot

    def pin(self, slot: int) -> None:
        self.pinned.add(slot)

    def allocate(self, rid: int, slot: int | None = None) -> int | None:
        """A pool slot for `rid`: `slot` (evicting its record), else the least recently used slot not pinned
        by this step, or None."""
        if slot is None:
            for slot in self.lru:
                if slot not in self.pinned:
                    break
            else:
                return None
        old = self.rid_of[slot]
        if old is not None:
            del self.slot_of[old]
            self.prefetched.discard(old)
        self.rid_of[slot], self.slot_of[rid] = rid, slot
        self.lru.move_to_end(slot)
        return slot

    def forget(self, slot: int) -> None:
        """The slot's fill failed: it holds no record (a later use fetches it again)."""
        rid = self.rid_of[slot]
        if rid is not None and self.slot_of.get(rid) == slot:
            del self.slot_of[rid]
            self.prefetched.discard(rid)
        if slot < self.num_slots:
            self.rid_of[slot] = None
        self.pending[slot] = self.ready[slot] = self.precision_of[slot] = None

    def ring_room(self, layer: int, used: set[int], hits: int, layers: int, experts: int):
        """What a ring step of `layer` using experts `used` (`hits` of them resident) may keep in the pool: the
        layer's resident slots it does not use (idle), the other slots a fill may take (spare), how many of those
        (room), and the layer's share (slots // layers)."""
        idle = [slot for e in range(experts) if e not in used and (slot := self.slot_of.get(layer * experts + e))
                is not None]
        share = self.num_slots // layers
        room = share - len(idle) - hits
        return idle, self.spare(layer, share, experts) if room > 0 else [], room, share

    def spare(self, layer: int, share: int, experts: int) -> list[int]:
        """Slots a fill for `layer` may take, least recently used first: free ones, and unpinned ones of other
        layers (record id // `experts`) holding more than `share` records (as a decode leaves them), down to it."""
        held = Counter(rid // experts for rid in self.slot_of)
        out = []
        for slot in self.lru:
            rid = self.rid_of[slot]
            owner = None if rid is None else rid // experts
            if owner is None or (owner != layer and held[owner] > share and slot not in self.pinned):
                out.append(slot)
                if owner is not None:
                    held[owner] -= 1
        return out

    def ring_slot(self, index: int) -> int:
        return self.num_slots + index % self.ring_slots

    @property
    def resident(self) -> int:
        return len(self.slot_of)
