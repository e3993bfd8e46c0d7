"""Speculative decoding's exactness on CUDA (bf16): verify steps captured per row count, resident and with the
experts spread over a small pool and the host tier, give the plain greedy tokens."""

import pytest

from moestream.engine.llm import LLM
from moestream.engine.lookup import PromptLookup
from moestream.sampling import SamplingParams
from tests.engine.runs import prompt_of, static_hyper_store
from tests.engine.test_invariance import MODEL_TYPES, _record_gb

pytestmark = pytest.mark.gpu

SETTINGS = [dict(), dict(pool_gb="min"), dict(pool_gb="half", host_gb=0.01), dict(decode_mode="eager")]


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "qwen4_exp_static"])
def test_gpu_greedy_tokens_with_drafts_are_the_plain_ones(tiny, tmp_path, model_type, monkeypatch):
    store = static_hyper_store(str(tmp_path / "s")) if model_type == "qwen4_exp_static" else tiny.store(model_type)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    llm = LLM(store, device="cuda", dtype="bfloat16")
    prompt = prompt_of(llm, 8) * 2
    try:
        want = llm.generate([prompt], params)[0].token_ids
    finally:
        llm.close()

    # the plain tokens, wrong 3 then 4 apart: no depth keeps pace with them and never meets one (with every third
    # wrong, adaptive depth settled at 2 drafts, each step's own token the wrong one)
    def oracle(lookup, k):
        at = len(lookup.tokens) - len(prompt)
        return [(t + 1) % 256 if (at + i) % 7 in (0, 3) else t for i, t in enumerate(want[at: at + k])]

    monkeypatch.setattr(PromptLookup, "propose", oracle)
    for setting in SETTINGS:
        s = dict(setting)
        if "pool_gb" in s:
            s["pool_gb"] = (2 if s["pool_gb"] == "min" else 16) * _record_gb(1) * 1.0001
        # offloaded, adaptive depth may rightly stop drafting: a fixed 3 drafts there
        for drafts in (None, 3) if not setting else (3,):
            llm = LLM(store, device="cuda", dtype="bfloat16", speculation="lookup", drafts=drafts, **s)
            try:
                got = llm.generate([prompt], params)[0].token_ids
                spec, graphs = llm.stats()["speculation"], sorted(k for k in llm.decoder.graphs if not k[1])
            finally:
                llm.close()
            assert got == want, (setting, drafts, spec)
            assert 0 < sum(spec["accepted"]) < sum(spec["proposed"]), (setting, spec)
            if not setting and model_type != "qwen4_exp":  # resident: a graph for every row count
                assert graphs == [(rows, False) for rows in range(1, 2 + (3 if drafts else 4))], graphs
