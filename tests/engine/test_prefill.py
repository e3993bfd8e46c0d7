"""A prompt's first forward padded to a fixed size (engine/prefill.py): the padding changes nothing of the prompt's
own rows, only whole short prompts of models without state along the rows are padded, and on CUDA with every expert
in the pool the forward is a CUDA graph with the eager forward's bits."""

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.engine.prefill import SHORT_SIZES, padded_size, padded_sizes
from moestream.experts.provider import ExpertStep, Padding
from moestream.layers.context import StepContext
from moestream.sampling import SamplingParams
from tests.engine.runs import prompt_of
from tests.engine.test_invariance import _record_gb


def test_padded_sizes():
    assert [padded_size(n) for n in (1, 32, 33, 500, 512, 513, 4096)] == [32, 32, 64, 512, 512, 513, 4096]
    assert padded_sizes() == SHORT_SIZES and SHORT_SIZES[-1] == 512
    longer = padded_sizes(2048, 4096)  # multiples of 512 past 512, within a chunk
    assert longer == (*SHORT_SIZES, 1024, 1536, 2048)
    assert [padded_size(n, longer) for n in (500, 513, 1100, 2048, 2049)] == [512, 1024, 1536, 2048, 2049]
    assert padded_sizes(4096, 1000) == SHORT_SIZES  # a whole prompt is at most a chunk


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_padding_changes_nothing_of_the_prompts_own_rows(tiny, model_type):
    """Whatever the extra rows hold, the prompt's own rows come out bit for bit the same: causal attention never
    reads them, and no expert computes them."""
    llm = LLM(tiny.store(model_type), device="cpu", dtype="float32")
    try:
        assert llm.model.pads_prompts
        prompt, size = prompt_of(llm, 40), 64
        padding = Padding(len(prompt), torch.tensor([len(prompt) * llm.config.num_experts_per_tok]))
        outs = []
        for seed in (1, 2):
            extra = prompt_of(llm, size - len(prompt), seed=seed)
            state = llm.model.new_state(llm.dtype, llm.device)
            ctx = StepContext(torch.arange(size), experts=ExpertStep(padding=padding))
            with torch.inference_mode():
                outs.append(llm.model(torch.tensor(prompt + extra), state, ctx)[: len(prompt)])
        assert torch.equal(outs[0], outs[1])
        with torch.inference_mode():
            plain = llm.model(torch.tensor(prompt), llm.model.new_state(llm.dtype, llm.device))
        assert torch.allclose(outs[0], plain, rtol=1e-4, atol=1e-4)
    finally:
        llm.close()


def test_only_whole_prompts_within_the_graph_tokens_of_a_model_without_row_state_are_padded(tiny):
    moe, hybrid = (LLM(tiny.store(t), device="cpu") for t in ("qwen3_moe", "qwen3_next"))
    longer = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_graph_tokens=1024)
    try:
        assert moe.prefiller.rows(40) == 64 and moe.prefiller.rows(600) == 600 and longer.prefiller.rows(600) == 1024
        ids, params = prompt_of(moe, 600, seed=5), SamplingParams(max_tokens=4)
        padded, plain = (llm.generate([ids], params)[0] for llm in (longer, moe))  # 600 rows run at 1024, and not
        assert padded.token_ids == plain.token_ids
        assert not hybrid.model.pads_prompts and hybrid.prefiller.rows(40) == 40
        state = moe.model.new_state(moe.dtype, moe.device)
        first = moe.prefiller(prompt_of(moe, 40), state)
        assert first.shape[0] == 40 and state.length == 40 and state.caches[0].length == 40
        assert state.caches[0].table.capacity >= 64  # the padded rows' cache positions are the sequence's
        more = moe.prefiller(prompt_of(moe, 8, seed=3), state)  # after the first forward: as it comes
        assert more.shape[0] == 8 and state.length == 48
    finally:
        for llm in (moe, hybrid, longer):
            llm.close()


@pytest.mark.gpu
def test_gpu_a_resident_prompt_replays_its_sizes_graph_with_the_eager_bits(tiny):
    """With every expert in the pool each padded size's forward is a graph captured at load: a request replays it,
    and its tokens and logits are those of the same padded forward run eagerly with a pool of two records. Sizes
    past 512 (`prefill_graph_tokens`) alike."""
    runs = []
    for pool_gb in (None, 2 * _record_gb(1) * 1.0001):  # every record, or one decode step's two
        llm = LLM(tiny.store("qwen3_moe"), device="cuda", dtype="bfloat16", pool_gb=pool_gb, prefill_graph_tokens=1024)
        try:
            before = llm.prefiller.replays
            outs = llm.generate([prompt_of(llm, n, seed=n) for n in (5, 40, 300, 700)],
                                SamplingParams(max_tokens=6, logprobs=2))
            runs.append(([o.token_ids for o in outs], [o.logprobs for o in outs], llm.prefiller.replays - before))
        finally:
            llm.close()
    (tokens, logprobs, replays), (ring_tokens, ring_logprobs, ring_replays) = runs
    assert replays == 4 and ring_replays == 0
    assert tokens == ring_tokens and logprobs == ring_logprobs
