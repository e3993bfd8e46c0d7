"""MTP drafting on CUDA (bf16): the head's steps captured per row count, resident, with a small pool and the host
tier, and eager; greedy tokens are the plain ones."""

import pytest

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams
from tests.engine.test_drafting import PARAMS, PROMPT

pytestmark = pytest.mark.gpu


def test_gpu_greedy_tokens_with_mtp_drafts_are_the_plain_ones():
    llm = LLM(DEMO_STORE, device="cuda")
    try:
        want = llm.generate([PROMPT], PARAMS)[0].token_ids
        quarter = llm.provider.pool.stride * llm.provider.geometry.num_records / 4e9
    finally:
        llm.close()
    for setting in (dict(), dict(drafts=3), dict(pool_gb=quarter, host_gb=0.1), dict(decode_mode="eager")):
        llm = LLM(DEMO_STORE, device="cuda", speculation="mtp", **setting)
        try:
            got = llm.generate([PROMPT], PARAMS)[0].token_ids
            spec, graphs, fused = llm.stats()["speculation"], sorted(llm.head.graphs), sorted(llm.fused.graphs)
            sampled = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.7, seed=3))[0]
        finally:
            llm.close()
        assert got == want, (setting, spec)
        if setting.get("drafts") or spec["proposed"][0] >= 16:  # adaptive depth may stop after 1 kept in 4
            assert spec["acceptance"][0] > 0.4, (setting, spec)  # of this prompt: 0.5-0.6 (CPU)
        assert spec["proposed"][0] > 0, (setting, spec)
        assert 0 < len(sampled.token_ids) <= 16
        if not setting:  # resident: a graph of the head for every row count, of the whole step for every k
            assert graphs == [(rows, False) for rows in range(1, 6)], graphs
            assert fused == [1, 2, 3, 4], fused
