"""The GPU pool: one device buffer of record slots and the residency table record -> slot.

Slots [0, num_slots) are the pool, never evicted while used by the current step; a miss takes, of the
`EVICTION_WINDOW` least recently used slots, the one whose record was looked up least (sampled LFU, as Redis
evicts: on the demo model's traces it keeps 7-13 points more hits than LRU at a quarter pool); slots
[num_slots, num_slots + ring_slots) are the prefill ring. Each slot remembers the fetch that is filling
it (`pending` and its copy's `ready` event: each None once waited on) and the compute event after its
last reader (`last_use`), so a copy never lands in a slot that a kernel may still read, and a kernel never
reads a slot before its copy.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import Future
from itertools import islice

import torch

EVICTION_WINDOW = 32
AGING = 16  # use counts halve every AGING * num_slots lookups, so yesterday's favourites do not stay forever


class ExpertPool:
    def __init__(self, num_slots: int, ring_slots: int, stride: int, device: torch.device):
        self.num_slots, self.ring_slots, self.stride = num_slots, ring_slots, stride
        self.buffer = torch.empty(num_slots + ring_slots, stride, dtype=torch.uint8, device=device)
        self.views = list(self.buffer.unbind())  # one view per slot, made once (the prefill ring asks often)
        total = num_slots + ring_slots
        self.slot_of: dict[int, int] = {}
        self.rid_of: list[int | None] = [None] * total
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # oldest first
        self.uses: Counter[int] = Counter()  # lookups per record, aged
        self.slot_uses = [-1] * total  # the uses of each slot's record (-1: free), for a C-level min
        self.lookups = 0
        self.pinned: set[int] = set()
        self.prefetched: set[int] = set()  # records fetched by lookahead and not used yet
        self.precision_of: list[str | None] = [None] * total  # a record keeps its precision while cached
        self.pending: list[Future | None] = [None] * total
        self.ready: list = [None] * total
        self.last_use: list = [None] * total

    def new_step(self) -> None:
        self.pinned.clear()

    def lookup(self, rid: int) -> int | None:
        return self.lookup_many([rid])[0]

    def lookup_many(self, rids: list[int]) -> list[int | None]:
        """Each record's slot (None: not resident), looked up in order, as `lookup` one by one: a resident prefill
        layer looks up every expert while the GPU waits, so the loop keeps to local names."""
        out, period = [], AGING * max(self.num_slots, 1)
        uses, slot_of, move_to_end = self.uses, self.slot_of, self.lru.move_to_end
        for rid in rids:
            count = uses[rid] = uses.get(rid, 0) + 1
            self.lookups += 1
            if self.lookups % period == 0:
                uses = self.uses = Counter({r: c // 2 for r, c in uses.items() if c > 1})
                self.slot_uses = [-1 if r is None else uses[r] for r in self.rid_of]
            slot = slot_of.get(rid)
            if slot is not None:
                self.slot_uses[slot] = count
                move_to_end(slot)
            out.append(slot)
        return out

    def pin(self, slot: int) -> None:
        self.pinned.add(slot)

    def allocate(self, rid: int, slot: int | None = None) -> int | None:
        """A pool slot for `rid`: `slot` (evicting its record), else a free slot, else the least used record's
        among the `EVICTION_WINDOW` least recently used slots not pinned by this step, or None."""
        if slot is None and (slot := self._victim()) is None:
            return None
        old = self.rid_of[slot]
        if old is not None:
            del self.slot_of[old]
            self.prefetched.discard(old)
        self.rid_of[slot], self.slot_of[rid], self.slot_uses[slot] = rid, slot, self.uses[rid]
        self.lru.move_to_end(slot)
        return slot

    def _victim(self) -> int | None:
        uses = self.slot_uses.__getitem__  # C-level calls only: a miss pays ~2 us here against LRU's ~0.2
        best = min(islice(self.lru, EVICTION_WINDOW), key=uses, default=None)
        if best in self.pinned:  # the step's own slots are the most recent: only a pool not much larger than a step
            window = [s for s in islice(self.lru, EVICTION_WINDOW + len(self.pinned)) if s not in self.pinned]
            best = min(window[:EVICTION_WINDOW], key=uses, default=None)
        return best

    def forget(self, slot: int) -> None:
        """The slot's fill failed: it holds no record (a later use fetches it again)."""
        rid = self.rid_of[slot]
        if rid is not None and self.slot_of.get(rid) == slot:
            del self.slot_of[rid]
            self.prefetched.discard(rid)
        if slot < self.num_slots:
            self.rid_of[slot], self.slot_uses[slot] = None, -1
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
