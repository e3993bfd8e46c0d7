"""The prefill ring's plan as pure data: which records stay in the pool, which stream through the ring, in which
batches, and when each batch's fetches may start."""

from moestream.experts.ring_plan import plan_ring


def plan(counts, hits=None, ready=None, idle=(), spare=(), room=0, share=0, ring_slots=64, group=16, guessed=None):
    n = len(counts)
    hits = hits or [None] * n
    ready = ready or [h is not None for h in hits]
    return plan_ring(counts, [100 + j for j in range(n)], hits, ready, list(idle), list(spare), room, share,
                     first_ring_slot=1000, ring_slots=ring_slots, group=group, guessed=guessed or {})


def test_the_most_used_experts_fill_the_layers_share_the_rest_stream():
    p = plan([1, 9, 3, 9, 2], idle=[7], spare=[8, 9], room=1, share=2)
    assert p.fills == [1, 3]  # the two most used (a tie keeps expert order), in expert order
    assert p.slots[1] == 7 and p.slots[3] == 8  # the layer's idle slot first (from the end), then a spare one
    assert p.ring == [0, 2, 4] and [p.slots[j] for j in p.ring] == [1000, 1001, 1002]
    assert p.batches == [[0, 1, 2, 3, 4]] and p.fetches == [([1, 3], [0, 2, 4])] and p.gates == [-1]


def test_residents_whose_copies_landed_compute_first():
    p = plan([4, 4, 4, 4], hits=[None, 5, None, 6], ready=[False, True, False, False], group=2)
    assert p.batches == [[1], [0, 2], [3]]  # 3 is resident but its copy is still in flight
    assert p.fills == [] and p.ring == [0, 2]


def test_a_ring_slot_is_refilled_only_after_the_batch_that_read_it():
    p = plan([1] * 5, ring_slots=2, group=1)
    assert [p.slots[j] for j in p.ring] == [1000, 1001, 1000, 1001, 1000]
    assert p.gates == [-1, -1, 0, 1, 2]  # ring job r waits for the batch of job r - 2


def test_early_fetches_of_the_right_record_are_taken():
    p = plan([1] * 3, ring_slots=4, guessed={0: 100, 1: 555, 2: 102})  # position 1 guessed another record
    assert p.taken == {0: 0, 2: 2}
    assert p.fetches == [([], [1])]
