"""Speculative decoding is exact: a verify step's rows have the bits of single decode steps, a rejection puts
every state back to after the kept rows, and greedy generation with drafts gives the tokens it gives without."""

import dataclasses
import re

import pytest
import torch

from moestream.engine.decode import Decoder
from moestream.engine.llm import LLM
from moestream.engine.lookup import PromptLookup
from moestream.engine.speculation import Depth, Speculator
from moestream.errors import ConfigError
from moestream.sampling import SamplingParams
from tests.conftest import MODEL_TYPES
from tests.engine.runs import prompt_of


def _llm(tiny, model_type: str, **options) -> LLM:
    extra = {"indexer_n_heads": 8} if model_type == "qwen4_exp" else {}  # PLE and QSA past its budget
    return LLM(tiny.store(model_type, **extra), device="cpu", dtype="float32", **options)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_verify_rows_are_decode_steps_and_rejection_rewinds(tiny, model_type):
    llm = _llm(tiny, model_type)  # outside inference mode: the fetch threads write its pool
    try:
        _verify_and_rewind(llm)
    finally:
        llm.close()


@torch.inference_mode()
def _verify_and_rewind(llm: LLM) -> None:
    cfg = dataclasses.replace(llm.engine_config, max_context=64)
    steps = Decoder(llm.model, llm.provider, cfg, llm.device, llm.dtype, static=True)
    verify = Decoder(llm.model, llm.provider, cfg, llm.device, llm.dtype, static=True, max_rows=4)
    prompt, drafts = prompt_of(llm, 12), prompt_of(llm, 4, seed=1)
    one, many = steps.new_state(), verify.new_state()
    for state in (one, many):
        llm.model(torch.tensor(prompt), state)
    _, rows = verify.forward(drafts, many)
    for row, token in zip(rows, drafts):
        assert torch.equal(steps.step(token, one), row)
    # keep two of the four rows: the next step is the one after two single steps
    one, kept = steps.new_state(), drafts[:2]
    llm.model(torch.tensor(prompt), one)
    for token in kept:
        steps.step(token, one)
    many.accept(kept, len(drafts))
    assert many.length == one.length and many.tokens == one.tokens
    assert torch.equal(verify.forward([7], many)[1][0], steps.step(7, one))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("drafts", [None, 1, 4])
def test_greedy_tokens_with_drafts_are_the_plain_ones(tiny, model_type, drafts, monkeypatch):
    """Drafts from an oracle of the plain output, every third one wrong, so that steps keep all, some and none of
    their drafts; every depth gives the plain tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = _llm(tiny, model_type)
    prompt = prompt_of(llm, 8) * 2
    try:
        want = llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()

    def oracle(lookup, k):
        at = len(lookup.tokens) - len(prompt)
        return [t if (at + i) % 3 else (t + 1) % 256 for i, t in enumerate(want[at: at + k])]

    monkeypatch.setattr(PromptLookup, "propose", oracle)
    llm = _llm(tiny, model_type, speculation="lookup", drafts=drafts)
    try:
        assert llm.generate([prompt], params)[0].token_ids == want
        spec = llm.stats()["speculation"]
        assert 0 < sum(spec["accepted"]) < sum(spec["proposed"]) and spec["tokens_per_step"] > 1
    finally:
        llm.close()


def test_prompt_lookup_keeps_the_plain_tokens(tiny):
    """Prompt lookup's own drafts (a prompt that repeats itself)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = _llm(tiny, "qwen3_next")
    prompt = prompt_of(llm, 8) * 3
    try:
        want = llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()
    llm = _llm(tiny, "qwen3_next", speculation="lookup")
    try:
        assert llm.generate([prompt], params)[0].token_ids == want
    finally:
        llm.close()


def test_plain_steps_leave_the_drafter_alone(tiny, monkeypatch):
    """At depth 0 a step with speculation on is a plain step: the drafter's host work is what every step would pay
    when drafts never pay (issue 29's every-draft-rejected bound)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = _llm(tiny, "qwen3_next")
    prompt = prompt_of(llm, 8)
    try:
        want = llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()

    def called(*args):
        raise AssertionError("a plain step called the drafter")

    for name in ("propose", "fused_step"):
        monkeypatch.setattr(Speculator, name, called)
    monkeypatch.setattr(Depth, "next", lambda self: 0)  # drafts turned off for good
    llm = _llm(tiny, "qwen3_next", speculation="lookup")
    try:
        assert llm.generate([prompt], params)[0].token_ids == want
    finally:
        llm.close()


@pytest.mark.parametrize("options, message", [
    (dict(speculation="mtp"), "--spec mtp: this qwen4_exp store has no MTP head (its checkpoint had no mtp.* "
                              "tensors); use --spec lookup"),
    (dict(speculation="lookup", ngram_tier="disk"), "--spec needs the n-gram tables in host memory"),
    (dict(speculation="lookup", drafts=5), "--drafts 5: choose 0..4"),
    (dict(speculation="draft"), "speculation 'draft': choose off, lookup, mtp"),
])
def test_speculation_options_a_run_cannot_honour_are_refused_in_one_line(tiny, options, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        LLM(tiny.store("qwen4_exp"), device="cpu", **options)
