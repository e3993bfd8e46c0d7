"""verify_cost's all-rejected run: every draft becomes one the greedy run does not pick, from prompt lookup or after
the MTP head ran as it would (its logits replaced on the device, so the fused step's drafts too), and the undo puts the
drafter back."""

import pytest

from benchmarks.verify_cost import all_rejected, reject_every_draft
from moestream.engine.drafting import HeadDecoder
from moestream.engine.llm import LLM
from moestream.engine.lookup import PromptLookup
from moestream.sampling import SamplingParams


@pytest.mark.parametrize("spec", ["lookup", "mtp"])
def test_every_draft_is_rejected_and_the_drafter_comes_back(tiny, spec):
    store = tiny.store("qwen4_exp", mtp=True, indexer_n_heads=8)
    owner, name = (HeadDecoder, "_run") if spec == "mtp" else (PromptLookup, "propose")
    original = getattr(owner, name)
    llm = LLM(store, device="cpu", dtype="float32", speculation=spec, drafts=2)
    try:
        undo = reject_every_draft(spec, llm.config.vocab_size - 1)
        prompt = list(range(5, 21)) * 2  # lookup finds its repeats
        llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
        undo()
        stats = llm.stats()["speculation"]
    finally:
        llm.close()
    assert getattr(owner, name) is original
    assert sum(stats["proposed"]) > 0 and sum(stats["accepted"]) == 0, stats


def test_all_rejected_interleaves_speculation_on_and_off(tiny):
    store = tiny.store("qwen4_exp", mtp=True, indexer_n_heads=8)
    llm = LLM(store, device="cpu", dtype="float32", speculation="lookup", drafts=2)
    config, propose = llm.engine_config, PromptLookup.propose
    try:
        out = all_rejected(llm, "lookup", rounds=2, tokens=6)
    finally:
        llm.close()
    assert llm.engine_config is config and PromptLookup.propose is propose
    assert [len(v) for v in out["rounds_tok_s"].values()] == [2, 2, 2]
    assert out["speculation"]["steps"] == 2 * 5 and sum(out["speculation"]["accepted"]) == 0, out
