"""Speculative decoding's acceptance keeps greedy tokens and the sampler's distribution; adaptive depth turns
drafts off when they stop paying and back on when they pay."""

import itertools
import random

import pytest
import torch

from moestream.engine.speculation import Depth, SpecStats, accept
from moestream.sampling import Sampler, SamplingParams


def logits_for(*rows):
    return torch.tensor(rows, dtype=torch.float32).log()


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_takes_the_argmax():
    sampler = Sampler(SamplingParams(), torch.device("cpu"))
    logits = logits_for([0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6])
    assert accept(sampler, logits, [1, 0], []) == [1, 0, 2]  # both kept, then the last row's token
    assert accept(sampler, logits, [1, 2], []) == [1, 0]  # the second draft is not row 1's argmax
    assert accept(sampler, logits[:1], [], []) == [1]  # no drafts: a plain step


def test_greedy_acceptance_sees_the_penalties_of_the_drafts_it_kept():
    sampler = Sampler(SamplingParams(repetition_penalty=10.0), torch.device("cpu"))
    logits = logits_for([0.1, 0.8, 0.1], [0.1, 0.5, 0.4])
    # without the kept draft 1 in its history, row 1's argmax would be 1 again
    assert accept(sampler, logits, [1], []) == [1, 2]


TARGETS = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]])


@pytest.mark.parametrize("draft", ["distribution", "point mass"])
def test_sampled_tokens_follow_the_target_distribution(draft):
    """Two draft positions: the first token's distribution and the second's given the first are the target's
    (the sampler's own: temperature 1), whether the draft came with a distribution (MTP) or without (lookup)."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"))
    draft_dist = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    generator = torch.Generator().manual_seed(1)
    trials, first, second = 20000, torch.zeros(4), torch.zeros(4)
    for _ in range(trials):
        drafts = [int(torch.multinomial(draft_dist[i], 1, generator=generator)) for i in range(2)]
        if draft == "point mass":
            drafts[0] = 1
        # the target's rows do not depend on the drafts here, so the second row holds whatever the first kept
        out = accept(sampler, TARGETS.log(), drafts, [], draft_dist if draft == "distribution" else None)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert torch.allclose(first / trials, TARGETS[0], atol=0.015)
    assert torch.allclose(second / second.sum(), TARGETS[1], atol=0.015)


def test_acceptance_honours_top_k():
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0), torch.device("cpu"))
    for _ in range(50):
        assert accept(sampler, TARGETS[:2].log(), [1], [])[0] == 0  # top-k 1: the draft is never drawable


def _drive(depth: Depth, steps: int, kept, cost, plain_first: bool = True, primed: bool = False) -> list[int]:
    """The depth chosen at each of `steps` steps, each keeping kept(k) of its k drafts at cost(k) seconds, after a
    plain step at 1.0 unless not `plain_first`; with `primed` a drafting step after a plain one is untimed (the fused
    MTP step first fed the head the rows it skipped)."""
    if plain_first:
        depth.update(0, 0, 1.0)
    chosen = []
    for _ in range(steps):
        k = depth.next()
        untimed = primed and k and not (chosen and chosen[-1])
        chosen.append(k)
        depth.update(k, kept(k), None if untimed else cost(k))
    return chosen


def _gaps(chosen: list[int], after: int = 0) -> list[int]:
    probes = [i for i, k in enumerate(chosen) if k and i >= after]
    return [b - a for a, b in zip(probes, probes[1:])]


def test_depth_falls_to_zero_when_every_draft_is_rejected_and_probes():
    depth = Depth(max_drafts=4, probe=8)
    chosen = _drive(depth, 1500, lambda k: 0, lambda k: 1.0 + 0.1 * k)
    assert depth.next() == 0 and set(chosen[40:]) == {0, 1}  # a cheap probe now and then
    gaps = _gaps(chosen, 40)  # each further from the last while none pays, up to 32x
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] == 32 * 8 + 1
    depth.update(1, 1, 1.1)  # a probe that paid: probing at the first pace again
    assert depth.wait == depth.probe


def _fresh(steps: int, kept, cost, seed: int = 0) -> list[int]:
    """As _drive, from a fresh depth (no plain step measured) and with kept(k, rng)."""
    rng = random.Random(seed)
    return _drive(Depth(max_drafts=4), steps, lambda k: kept(k, rng), cost, plain_first=False)


def test_rejected_drafts_stop_soon_even_when_cheap():
    """A row at 10% of a step, every draft rejected: the prior's 1 in 2 fades with the evidence (fixed, it kept the
    estimate above 1 in 12, and drafts at 8% looked worth their cost)."""
    chosen = _fresh(200, lambda k, rng: 0, lambda k: 1.0 + 0.1 * k)
    assert sum(k > 0 for k in chosen[:40]) <= 8 and sum(k > 0 for k in chosen[40:]) <= 4, chosen


def test_kept_drafts_that_cost_more_than_they_yield_are_measured_and_stopped():
    """Drafts kept 7 in 10 a position at 0.9 of a step a row: a plain step is measured once drafts have run, and
    the depth falls to 0 (without one the prior's 0.1 a row priced them for good: 0.58x plain, simulated)."""
    def kept(k, rng):
        return next((i for i in range(k) if rng.random() >= 0.7), k)

    chosen = _fresh(300, kept, lambda k: 1.0 + 0.9 * k)
    assert 0 in chosen[:4] and chosen[100:].count(0) >= 180, chosen


def test_an_untimed_step_counts_its_drafts_but_not_its_cost():
    depth = Depth(max_drafts=4)
    depth.update(0, 0, 1.0)
    depth.update(2, 2, None)  # e.g. a step that first fed the MTP head the rows it had skipped
    assert 2 not in depth.measured and depth.trials[1] == 1.0


def test_one_stalled_step_does_not_stop_kept_drafts():
    """A draft step stalled 50x (a GC pause) weighs as one at 2x: smoothed as it came, the depth's cost stood 5x
    a plain step and drafts stopped until the next probe (the demo model's slow runs were untimed probes' doing)."""
    depth = Depth(max_drafts=1, probe=1000)
    depth.update(0, 0, 1.0)
    for _ in range(20):
        depth.update(1, 1, 1.2)
    depth.update(1, 1, 60.0)
    assert [depth.next() for _ in range(5)] == [1] * 5


def test_a_slow_first_measure_does_not_stop_drafts_for_good():
    """The first timed draft step 20x its cost, every probe after it untimed (the head first fed the rows it
    skipped): a timed step follows each probe and replaces the stale cost (a demo run sat at 0.94x, 4 probes in
    4,565 steps, none timed)."""
    costs = iter([20.0])
    chosen = _drive(Depth(max_drafts=1, probe=8), 400, lambda k: k, lambda k: next(costs, 1.2), primed=True)
    assert chosen[:3] == [1, 1, 0] and chosen[-100:].count(1) >= 90, chosen  # before: 6 steps of 400 drafted


def test_depth_chooses_again_when_the_plain_cost_it_was_priced_on_moves():
    """A first plain step faster than the rest stops a kept draft; as the plain cost settles the draft pays again,
    well before the next probe (the choice kept until a probe, eager decode drafted 3 times in 40 tokens)."""
    depth = Depth(max_drafts=1, probe=100)
    depth.update(1, 1, 1.5)
    assert depth.next() == 0  # a plain step to price the draft
    depth.update(0, 0, 0.7)
    chosen = []
    for _ in range(20):
        chosen.append(depth.next())
        depth.update(chosen[-1], chosen[-1], 1.5 if chosen[-1] else 1.0)
    assert chosen[0] == 0 and 1 in chosen, chosen


def test_depth_grows_when_drafts_are_kept_and_cheap():
    depth = Depth(max_drafts=4)
    depth.update(0, 0, 1.0)
    for _ in range(30):
        k = depth.next()
        depth.update(k, k, 1.0 + 0.05 * k)
    assert depth.next() == 4
    assert Depth(max_drafts=4, fixed=2).next() == 2


def test_probes_back_off_while_kept_drafts_cost_more_than_they_yield():
    """Every draft kept, but a two-row step costs 2.5 plain ones: probes come ever further apart."""
    chosen = _drive(Depth(max_drafts=4, probe=8), 600, lambda k: k, lambda k: 1.0 + 1.5 * k)
    gaps = _gaps(chosen)
    assert set(chosen[40:]) == {0, 1} and gaps[-1] > 4 * gaps[0], gaps


def test_depth_stops_where_chained_drafts_stop_paying():
    """An MTP head's first draft kept 9 times in 10, the drafts chained after it 2 in 10: one draft pays, more
    do not, at rows costing 30% each (a deeper draft is only tried now and then)."""
    rng = random.Random(0)

    def kept(k):
        return next((i for i in range(k) if rng.random() >= (0.9 if i == 0 else 0.2)), k)

    depth = Depth(max_drafts=4)
    chosen = _drive(depth, 400, kept, lambda k: 1.0 + 0.3 * k)
    assert chosen[-100:].count(1) >= 90 and max(chosen[-100:]) == 2
    assert depth.expected_tokens(1) > 1.8


def test_a_deeper_draft_is_tried_after_an_unlucky_start():
    """Every draft kept but the second, for the first 20 steps: at rows costing 10% each the depth still reaches 4
    (judged once unlucky, never judged again, it stayed at 1)."""
    step = itertools.count()
    chosen = _drive(Depth(max_drafts=4), 400, lambda k: k if next(step) >= 20 else min(k, 1),
                    lambda k: 1.0 + 0.1 * k)
    assert chosen[-50:].count(4) >= 45


def test_stats_count_per_draft_position():
    stats = SpecStats()
    stats.record(3, 1, 0.01)
    stats.record(2, 2, 0.02)
    out = stats.as_dict()
    assert out["proposed"] == [2, 2, 1] and out["accepted"] == [2, 1, 0]
    assert out["tokens_per_step"] == (2 + 3) / 2 and set(out["step_ms"]) == {2, 3}
    assert out["steps_at"] == {2: 1, 3: 1}
