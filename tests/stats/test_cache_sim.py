"""The cache simulator on hand-made traces whose answers are known, and MIN against an exhaustive search."""

import functools
import random

import pytest

from moestream.experts import replay
from moestream.stats import cache_sim
from moestream.stats.trace import RoutingTrace, parse


def trace_of(tokens: list[list[list[int]]], experts: int, prefill_min_rows: int = 32):
    """tokens[t][layer] = experts of token t at layer, fed one token a step (decode), layer by layer."""
    lines = []
    layers, top_k = len(tokens[0]), len(tokens[0][0])
    rec = RoutingTrace(lines, layers, experts, top_k, prefill_min_rows)
    for token in tokens:
        for layer, ids in enumerate(token):
            rec.step(layer, [ids])
    return parse(lines)


def optimum(seq: list[int], slots: int) -> int:
    """The most hits any demand policy that may decline to keep a miss can get (exhaustive)."""
    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        r = seq[i]
        if r in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]
        if len(cache) < slots:
            options.append(best(i + 1, cache | {r}))
        else:
            options += [best(i + 1, (cache - {v}) | {r}) for v in cache]
        return max(options)
    return best(0, frozenset())


def test_a_cycle_one_longer_than_the_pool_defeats_lru_but_not_min():
    seq = [0, 1, 2, 3] * 6  # 4 records, a pool of 3
    assert cache_sim.lru(seq, 3) == 0
    assert cache_sim.belady(seq, 3) == optimum(seq, 3) > 0
    t = trace_of([[[e]] for e in seq], experts=4)
    assert replay.engine(t, 3) == 0  # decode steps: LRU over slots


def test_a_hot_record_among_a_scan_favours_lfu():
    seq = [x for i in range(10) for x in (0, 100 + 2 * i, 101 + 2 * i)]  # 0 is used every third lookup
    assert cache_sim.lru(seq, 2) == 0
    assert cache_sim.lfu(seq, 2) == 8  # its first reuse misses: at 101 it had no more uses than 100
    assert cache_sim.belady(seq, 2) == 9


@pytest.mark.parametrize("seed", range(20))
def test_min_is_optimal_and_beats_every_policy(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(6) for _ in range(rng.randrange(5, 14))]
    slots = rng.randrange(1, 5)
    assert cache_sim.belady(seq, slots) == optimum(seq, slots)
    assert cache_sim.belady(seq, slots) >= max(cache_sim.lru(seq, slots), cache_sim.lfu(seq, slots))


@pytest.mark.parametrize("seed", range(10))
def test_min_bounds_the_engine_on_random_traces(seed):
    rng = random.Random(seed)
    layers, experts, top_k = 3, 8, 2
    rows = lambda n: [rng.sample(range(experts), top_k) for _ in range(n)]  # noqa: E731
    lines = []
    rec = RoutingTrace(lines, layers, experts, top_k, prefill_min_rows=4)
    for n in [6] + [1] * 30:  # a prompt through the ring, then decode
        for layer in range(layers):
            rec.step(layer, rows(n))
    t = parse(lines)
    seq = cache_sim.lookups(t)
    for slots in (2, 6, 12, 24):
        hits = {p: replay.simulate(t, [slots])["hits"][p][0] for p in replay.POLICIES}
        assert hits["min"] == max(hits.values()), (slots, hits)
    assert cache_sim.belady(seq, t.records) == len(seq) - len(set(seq))


def test_a_full_pool_misses_only_the_first_use_of_each_record():
    rng = random.Random(1)
    t = trace_of([[rng.sample(range(8), 2) for _ in range(2)] for _ in range(40)], experts=8)
    out = replay.simulate(t, [t.records])
    compulsory = out["lookups"] - out["compulsory"]
    assert all(h == [compulsory] for h in out["hits"].values()), out["hits"]
    assert replay.engine(t, t.records, preloaded=True) == out["lookups"]


def test_the_ring_keeps_a_layers_most_used_experts_within_its_share():
    lines = []
    rec = RoutingTrace(lines, 2, 8, 1, prefill_min_rows=4)
    rec.step(0, [[3], [3], [3], [5], [5], [1]])  # a ring step: share = 4 slots // 2 layers = 2
    rec.step(0, [[3]])
    rec.step(0, [[5]])
    rec.step(0, [[1]])
    assert replay.engine(parse(lines), 4) == 2  # 3 and 5 stayed, 1 streamed through the ring


def test_reuse_counts_token_to_token_overlap_per_layer():
    t = trace_of([[[0, 1], [4, 5]], [[1, 2], [4, 5]], [[1, 2], [6, 7]]], experts=8)
    assert cache_sim.reuse(t) == [pytest.approx(0.75), pytest.approx(0.5)]


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    from moestream.stats import trace

    path = tmp_path / "x.jsonl"
    path.write_text('{"layer": 0}\n')
    with pytest.raises(ValueError, match="not a routing trace"):
        trace.load(str(path))
