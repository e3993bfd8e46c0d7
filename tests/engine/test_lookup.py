"""Prompt lookup proposes what followed the latest earlier occurrence of the longest matching suffix, and the same
drafts whether the index was built at once or token by token."""

import random

from moestream.engine.lookup import PromptLookup


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence with at least one token after it
            if tokens[end + 1 - n: end + 1] == suffix:
                return tokens[end + 1: end + 1 + k]
    return []


def test_drafts_follow_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    lookup.reset([5, 6, 7, 8, 1, 2, 3, 9, 9, 1, 2, 3])
    assert lookup.propose(3) == [9, 9, 1]  # "1 2 3" last occurred before the suffix at 4..6
    lookup.extend([4])
    assert lookup.propose(2) == []  # 4 never occurred before
    lookup.reset([1, 2, 1, 2, 1])
    assert lookup.propose(4) == [2, 1]  # "1 2 1" ending at 2: what follows runs to the end


def test_equals_a_brute_force_search_incrementally():
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        max_ngram, min_ngram = rng.randrange(1, 5), 1
        min_ngram = rng.randrange(1, max_ngram + 1)
        whole, step = PromptLookup(max_ngram, min_ngram), PromptLookup(max_ngram, min_ngram)
        whole.reset(tokens)
        step.reset(tokens[:1])
        for t in tokens[1:]:
            step.extend([t])
        want = brute_force(tokens, 3, max_ngram, min_ngram)
        assert whole.propose(3) == want == step.propose(3), (trial, tokens)
