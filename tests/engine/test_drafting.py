"""MTP drafting (engine/drafting.py) on the trained demo model: the head's static steps are its eager forward,
and greedy generation with its drafts gives the plain tokens on every tier, a cached prefix included."""

import pytest
import torch

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.engine.speculation import Speculator
from moestream.sampling import SamplingParams

PROMPT = ("def parse(tokens):\n    \"\"\"Return the tree of the tokens.\"\"\"\n    stack = []\n"
          "    for token in tokens:\n        if token == '(':\n            stack.append([])\n")
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def _llm(**options) -> LLM:
    return LLM(DEMO_STORE, device="cpu", dtype="float32", **options)


@pytest.fixture(scope="module")
def plain() -> list[int]:
    llm = _llm()
    try:
        return llm.generate([PROMPT], PARAMS)[0].token_ids
    finally:
        llm.close()


def test_the_heads_static_steps_are_its_eager_forward():
    llm = _llm(speculation="mtp", drafts=3)
    try:
        assert_static_steps_are_eager(llm, torch.tensor(llm.tokenizer.encode(PROMPT)))
    finally:
        llm.close()


@torch.inference_mode()
def assert_static_steps_are_eager(llm: LLM, ids: torch.Tensor) -> None:
    """The head's static steps, 3 rows at a time, give the logits of its eager forward over the prompt."""
    model = llm.model
    hidden = model(ids, model.new_state(llm.dtype, llm.device))
    want = model.draft_logits(model.draft(hidden[:-1], ids[1:], model.mtp.new_state(llm.dtype, llm.device)))
    state, got = llm.head.new_state(), []
    for at in range(0, len(ids) - 1, 3):
        rows = ids[at + 1: at + 4].tolist()
        got.append(llm.head.forward(rows, state, hidden[at: at + len(rows)])[1])
        state.advance(rows)
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def _record_bytes() -> int:
    llm = _llm()
    try:
        return llm.provider.pool.stride * llm.provider.geometry.num_records
    finally:
        llm.close()


@pytest.mark.parametrize("tier", ["resident", "pool + host", "pool + disk"])
def test_greedy_tokens_with_mtp_drafts_are_the_plain_ones(plain, tier):
    """At a fixed depth: on the CPU a draft step costs 2-3 plain ones, and adaptive depth rightly drafts little."""
    quarter = _record_bytes() / 4e9
    options = {"resident": {}, "pool + host": dict(pool_gb=quarter, host_gb=1.0),
               "pool + disk": dict(pool_gb=quarter, host_gb=0)}[tier]
    llm = _llm(speculation="mtp", drafts=2, **options)
    try:
        assert llm.generate([PROMPT], PARAMS)[0].token_ids == plain
        spec = llm.stats()["speculation"]
    finally:
        llm.close()
    assert spec["acceptance"][0] > 0.5 and spec["tokens_per_step"] > 1.5, spec


def test_a_cached_prefix_restores_the_heads_state_too(plain):
    """Prefill cut every 16 tokens, the second request from the cache: the same tokens and the same drafts."""
    llm = _llm(speculation="mtp", drafts=2, prefill_chunk=16, prefix_cache_mb=64)
    try:
        runs = []
        for _ in range(2):
            before = dict(llm.stats()["speculation"])
            tokens = llm.generate([PROMPT], PARAMS)[0].token_ids
            after = llm.stats()["speculation"]
            runs.append((tokens, [a - b for a, b in zip(after["accepted"], before["accepted"] or [0, 0])]))
        assert llm.prefix_cache.stats()["hits"] == 1
    finally:
        llm.close()
    assert runs[0] == runs[1] and runs[0][0] == plain


@pytest.mark.parametrize("drafts", [1, 3])
def test_the_fused_step_drafts_what_separate_steps_draft(plain, monkeypatch, drafts):
    """A greedy step as one (FusedDrafts: the head fed every verified row, the next draft left on the device) keeps
    the drafts that a head step, a verify step and a catch-up keep: the head's rows have the bits of single steps."""
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Speculator, "fused_step", lambda *args: None)
        llm = _llm(speculation="mtp", drafts=drafts)
        try:
            runs.append((llm.generate([PROMPT], PARAMS)[0].token_ids, llm.stats()["speculation"]["accepted"]))
        finally:
            llm.close()
    assert runs[0] == runs[1] and runs[0][0] == plain, runs


def test_sampling_with_mtp_drafts_runs_to_its_length():
    llm = _llm(speculation="mtp")
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True))[0]
        assert len(out.token_ids) == 30 and llm.stats()["speculation"]["steps"] > 0
    finally:
        llm.close()
