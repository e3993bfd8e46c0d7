"""qwen4_exp's MTP head on CUDA (bf16): its steps are CUDA graphs per row count, and greedy tokens with its drafts
are the plain ones, resident and with a small pool and the host tier."""

import pytest

from tests.engine.test_drafting_qwen4_exp import greedy_with_oracle_drafts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("drafts", [None, 3])
@pytest.mark.parametrize("tier", ["resident", "pool + host"])
def test_gpu_greedy_tokens_with_its_drafts_are_the_plain_ones(tiny, tier, drafts, monkeypatch):
    graphs = greedy_with_oracle_drafts(tiny, "cuda", tier, monkeypatch, drafts)
    assert graphs == [(rows, False) for rows in range(1, 2 + (drafts or 4))], graphs  # k drafts: up to k+1 rows
