"""The prefill ring's early fetches for the next layer: taken when the guess is right, harmless when it is
wrong (every slot a batch names holds the record it asks for)."""

import torch

from moestream.engine.llm import LLM
from moestream.experts.format import RecordLayout
from moestream.experts.provider import ExpertStep
from moestream.sampling import SamplingParams
from tests.engine.runs import prompt_of

STRIDE = RecordLayout.build("q4", 64, 64).stride


def test_next_layer_ring_fetches_start_early_and_are_taken(tiny):
    store = tiny.store("qwen3_moe")
    whole = LLM(store, device="cpu")
    small = LLM(store, device="cpu", pool_gb=2.0001 * STRIDE / 1e9, ring_lookahead=True)  # share 0: all guessed
    try:
        ids = prompt_of(small, 48)  # 96 routing entries, 12 per expert: every expert is used
        params = SamplingParams(max_tokens=4)
        assert small.generate([ids], params)[0].token_ids == whole.generate([ids], params)[0].token_ids
        layers = small.stats()["layers"]
        assert layers[0]["q4"]["prefetch_used"] == 0  # nothing runs before the first layer
        for layer in layers[1:]:
            c = layer["q4"]
            assert 0 < c["prefetch_used"] <= c["prefetch_issued"]
    finally:
        whole.close()
        small.close()


def test_a_wrong_guess_costs_a_copy_not_a_result(tiny):
    store = tiny.store("qwen3_moe")
    llm = LLM(store, device="cpu", pool_gb=2.0001 * STRIDE / 1e9, ring_lookahead=True)
    try:
        provider = llm.provider
        every = torch.arange(96).remainder(8).reshape(48, 2)  # every expert: layer 1's ring is guessed
        step = ExpertStep()
        for _ in provider.parts(0, every, torch.zeros(48, 64), step):
            pass
        assert step.ahead is not None and step.ahead.layer == 1  # layer 0's step returned it for layer 1
        skips_0 = every.clamp(min=1)  # expert 0 unused: every guessed ring position is now off by one
        records = open(f"{store}/experts.q4.bin", "rb").read()
        batches = 0
        for b in provider.parts(1, skips_0, torch.zeros(48, 64), step):
            for e, slot in zip(b.experts, b.slots):
                rid = provider.geometry.rid(1, e)
                assert bytes(b.buffer[slot].numpy()) == records[rid * STRIDE:(rid + 1) * STRIDE], (e, slot)
            batches += 1
        assert batches and llm.stats()["layers"][1]["q4"]["prefetch_issued"] > 0
    finally:
        llm.close()


def test_off_when_asked(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=2.0001 * STRIDE / 1e9, ring_lookahead=False)
    try:
        llm.generate([prompt_of(llm, 48)], SamplingParams(max_tokens=1))  # a prefill and no decode step
        assert llm.stats()["totals"]["q4"]["prefetch_issued"] == 0
    finally:
        llm.close()


def test_early_fetches_go_one_ring_batch_per_call(tiny, monkeypatch):
    """Copies of one fetch call share a ready event, so the early fetches go one ring batch a call: the next
    layer's first batch then waits for its own copies, not for the whole ring's."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=2.0001 * STRIDE / 1e9, host_gb=0.01,
              ring_lookahead=True, ring_group=2)
    try:
        calls, fetch = [], llm.provider.residency.fetch

        def spy(layer, items, precision, ring=False, early=False):
            calls.append(len(items)) if early else None
            return fetch(layer, items, precision, ring=ring, early=early)

        monkeypatch.setattr(llm.provider.residency, "fetch", spy)
        llm.generate([prompt_of(llm, 48)], SamplingParams(max_tokens=1))
        assert calls and max(calls) == 2
    finally:
        llm.close()


def test_a_ring_batch_larger_than_the_ring_still_computes_the_same(tiny):
    """A batch's copies go out together, so a batch cannot hold more experts than the ring has slots: the
    default batch of 16 with `--ring 4` runs in batches of 4."""
    store = tiny.store("qwen3_moe")
    whole = LLM(store, device="cpu")
    small = LLM(store, device="cpu", pool_gb=2.0001 * STRIDE / 1e9, ring_slots=4)
    try:
        ids, params = prompt_of(small, 48), SamplingParams(max_tokens=4)
        assert small.generate([ids], params)[0].token_ids == whole.generate([ids], params)[0].token_ids
    finally:
        whole.close()
        small.close()
