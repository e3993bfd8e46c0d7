"""The pool's eviction: a record used often outlives a run of records used once (LRU would drop it)."""

import torch

from moestream.experts.pool import ExpertPool


def step(pool: ExpertPool, rids: list[int]) -> int:
    """One layer step over `rids`: hits pinned, misses allocated; returns the hits."""
    pool.new_step()
    found = [pool.lookup(r) for r in rids]
    for r, slot in zip(rids, found):
        pool.pin(slot if slot is not None else pool.allocate(r))
    return sum(f is not None for f in found)


def test_a_hot_record_survives_a_scan_of_cold_ones():
    pool = ExpertPool(4, 1, 0, torch.device("cpu"))
    for _ in range(5):
        step(pool, [0])
    for cold in range(100, 120):  # each used once: LRU would have evicted record 0 after the fourth
        step(pool, [cold])
    assert step(pool, [0]) == 1


def test_a_free_slot_goes_first_and_a_step_never_evicts_its_own_records():
    pool = ExpertPool(2, 1, 0, torch.device("cpu"))
    step(pool, [1, 2])
    freed = pool.lookup(1)
    pool.forget(freed)  # a failed fill leaves its slot free
    pool.new_step()
    pinned = pool.lookup(2)
    pool.pin(pinned)
    assert pool.allocate(7) == freed
    pool.pin(freed)
    assert pool.allocate(8) is None and pool.lookup(2) == pinned  # every slot is this step's


def test_a_step_of_lookups_counts_and_ages_as_one_lookup_at_a_time():
    def one_by_one(pool: ExpertPool, rid: int):  # the pool's lookup before it went in bulk
        uses = pool.uses[rid] = pool.uses[rid] + 1
        pool.lookups += 1
        if pool.lookups % (16 * pool.num_slots) == 0:
            pool.uses = type(pool.uses)({r: c // 2 for r, c in pool.uses.items() if c > 1})
            pool.slot_uses = [-1 if r is None else pool.uses[r] for r in pool.rid_of]
        slot = pool.slot_of.get(rid)
        if slot is not None:
            pool.slot_uses[slot] = uses
            pool.lru.move_to_end(slot)
        return slot

    bulk, single = (ExpertPool(4, 1, 0, torch.device("cpu")) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    for _ in range(40):  # 40 steps of 6 lookups cross the aging period (64) three times
        rids = torch.randperm(10, generator=g)[:6].tolist()  # a step's experts are distinct
        for pool, found in ((bulk, bulk.lookup_many(rids)), (single, [one_by_one(single, r) for r in rids])):
            pool.new_step()
            for r, slot in zip(rids, found):
                pool.pin(slot if slot is not None else pool.allocate(r))
        assert bulk.slot_of == single.slot_of and list(bulk.lru) == list(single.lru)
        assert bulk.uses == single.uses and bulk.slot_uses == single.slot_uses
