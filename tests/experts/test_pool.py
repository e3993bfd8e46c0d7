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
