"""MTP drafting with qwen4_exp's own head (hyper-connection streams in and out, QSA and PLE in the trunk): its static
steps are its eager forward, and greedy generation with its drafts gives the plain tokens on every tier."""

import pytest
import torch

from moestream.engine.drafting import HeadDecoder
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams
from tests.engine.runs import prompt_of
from tests.engine.test_drafting import assert_static_steps_are_eager

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def _llm(tiny, device: str = "cpu", **options) -> LLM:
    store = tiny.store("qwen4_exp", mtp=True, indexer_n_heads=8)  # PLE, and QSA past its budget
    return LLM(store, device=device, dtype="float32" if device == "cpu" else "bfloat16", **options)


def test_the_head_is_loaded_only_to_draft(tiny):
    """A store's MTP head stays on the disk unless --spec mtp asks for it: its weights would take GPU memory."""
    for speculation in ("off", "mtp"):
        llm = _llm(tiny, speculation=speculation)
        try:
            assert hasattr(llm.model, "mtp") == (speculation == "mtp")
        finally:
            llm.close()


def test_the_heads_static_steps_are_its_eager_forward(tiny):
    llm = _llm(tiny, speculation="mtp", drafts=3)
    try:
        assert_static_steps_are_eager(llm, torch.tensor(prompt_of(llm, 40)))
    finally:
        llm.close()


@pytest.mark.parametrize("drafts", [None, 3])
@pytest.mark.parametrize("tier", ["resident", "pool + host", "pool + disk"])
def test_greedy_tokens_with_its_drafts_are_the_plain_ones(tiny, tier, drafts, monkeypatch):
    """The head runs as it would, and its logits are then swapped for the plain output with every third one wrong
    (a random head's are rarely kept), so that steps keep all, some and none of them."""
    greedy_with_oracle_drafts(tiny, "cpu", tier, monkeypatch, drafts)


def greedy_with_oracle_drafts(tiny, device: str, tier: str, monkeypatch,
                              drafts: int | None = None) -> list[tuple[int, bool]]:
    """Asserts the plain tokens; returns the head's graphs. The oracle is device work (a row at position p guesses
    x[p+2] from a table), so it runs inside captured steps, the whole fused step's (drafting.py) included."""
    llm = _llm(tiny, device)
    prompt = prompt_of(llm, 16)
    try:
        want = llm.generate([prompt], PARAMS)[0].token_ids
        records = llm.provider.pool.stride * llm.provider.geometry.num_records
        vocab = llm.config.vocab_size
    finally:
        llm.close()
    guesses = [t if i % 3 else (t + 1) % vocab for i, t in enumerate(want)]
    table = torch.tensor([0] * len(prompt) + guesses + [0] * 8, device=device)
    run = HeadDecoder._run

    def oracle(head, key, state, addresses, **options):
        hidden, logits = run(head, key, state, addresses, **options)
        at = (head._inputs(*key).positions + 2).clamp(max=len(table) - 1)
        return hidden, torch.nn.functional.one_hot(table[at], logits.shape[-1]).float()

    monkeypatch.setattr(HeadDecoder, "_run", oracle)
    options = {"resident": {}, "pool + host": dict(pool_gb=records / 4e9, host_gb=1.0),
               "pool + disk": dict(pool_gb=records / 4e9, host_gb=0)}[tier]
    llm = _llm(tiny, device, speculation="mtp", drafts=drafts, **options)
    try:
        assert llm.generate([prompt], PARAMS)[0].token_ids == want
        spec, graphs = llm.stats()["speculation"], sorted(llm.head.graphs)
    finally:
        llm.close()
    # adaptive depth drafts as the timings allow: a CPU run's 6 drafts met no wrong one
    assert 0 < sum(spec["accepted"]) and (drafts is None or sum(spec["accepted"]) < sum(spec["proposed"])), spec
    return graphs
