"""The prefill ring's plan for one layer step (the seed, DESIGN.md section 3): which slot each expert is read
from, which records go to the pool and stay for decode, which stream through the ring, in which batches, and
when each batch's fetches may start. Pure data in, data out: no pool, no device.

- The layer keeps up to `share` records: its most used experts (ties in expert order) that are not resident
  take the slots of its residents this step does not use first, then `spare` ones (free, or of layers above
  their share) while `room` lasts.
- The rest stream through `ring_slots` ring slots in expert order: ring job r reads slot `first_ring_slot +
  r % ring_slots`, so its batch's fetches wait until the batch of ring job r - ring_slots is done (its gate).
- Residents whose copies have landed compute first, in one batch, while the copies stream; the rest follow in
  expert order, `group` at a time (a batch's composition never changes a row's arithmetic).
- A ring job whose record was fetched early into its slot (`guessed`: ring position -> record id) is taken:
  no fetch and no gate of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RingPlan:
    slots: list[int]  # per expert (index into the step's grouping): the slot it is read from
    fills: list[int]  # experts fetched into the pool (slots[j]), where they stay
    ring: list[int]  # experts streamed through the ring, by ring position
    taken: dict[int, int]  # expert -> ring position whose early fetch is its record
    batches: list[list[int]]  # experts per batch, in compute order
    fetches: list[tuple[list[int], list[int]]]  # per batch: (fills, ring jobs) whose fetches go out with it
    gates: list[int]  # batch b's fetches wait until batch gates[b] is done (-1: at once)


def plan_ring(counts: list[int], rids: list[int], hits: list[int | None], ready: list[bool], idle: list[int],
              spare: list[int], room: int, share: int, first_ring_slot: int, ring_slots: int, group: int,
              guessed: dict[int, int]) -> RingPlan:
    """`counts`, `rids`: per expert of the step, its routing entries and record id; `hits`: its pool slot when
    resident, `ready`: whether that slot's copy has landed; `idle`: the layer's resident slots this step does not
    use (taken from the end first); `spare`: other slots a fill may take, in order."""
    idle, spare = list(idle), list(spare)
    keep = set(sorted(range(len(counts)), key=lambda j: -counts[j])[:share])  # stable: ties keep expert order
    slots, fills, ring = list(hits), [], []
    for j in range(len(counts)):
        if slots[j] is not None:
            continue
        if j in keep and idle:
            slots[j] = idle.pop()
        elif j in keep and room > 0 and spare:
            slots[j] = spare.pop(0)
            room -= 1
        if slots[j] is not None:
            fills.append(j)
        else:
            slots[j] = first_ring_slot + len(ring) % ring_slots
            ring.append(j)
    fetched = set(fills) | set(ring)
    present = [j for j in range(len(counts)) if j not in fetched and ready[j]]
    rest = sorted(set(range(len(counts))) - set(present))
    batches = ([present] if present else []) + [rest[i: i + group] for i in range(0, len(rest), group)]
    batch_of = {j: b for b, idx in enumerate(batches) for j in idx}
    fetches = [([], []) for _ in batches]
    gates = [-1] * len(batches)
    for j in fills:
        fetches[batch_of[j]][0].append(j)
    taken = {}
    for r, j in enumerate(ring):
        if guessed.get(r) == rids[j]:  # already on its way into this very slot
            taken[j] = r
            continue
        b = batch_of[j]
        fetches[b][1].append(j)
        gates[b] = max(gates[b], batch_of[ring[r - ring_slots]] if r >= ring_slots else -1)
    return RingPlan(slots, fills, ring, taken, batches, fetches, gates)
