"""Must-show of the real-size Flash-Next issue, on tiny configs: a qwen4_exp decode step with PLE layers (n-gram
table on the host tier, or on disk with a step's rows staged) and QSA past its budget is one CUDA graph replay,
with the greedy tokens of the eager forward and of transformers."""

import pytest
import torch

from moestream.engine.llm import LLM
from tests.engine.runs import greedy_trace
from tests.models.oracle import hf_logits
from tests.models.test_qwen4_exp import VARIANTS, prompt

pytestmark = pytest.mark.gpu
STEPS = 16


@pytest.mark.parametrize("variant, tier", [("base", "host"), ("hc4-gqa8", "host"), ("base", "disk")])
def test_gpu_decode_with_ple_and_qsa_is_one_graph(tiny, variant, tier):
    # eight index heads: exact block-score ties, which the graph breaks by block index and transformers by its
    # topk, become unlikely
    overrides = VARIANTS[variant] | dict(indexer_n_heads=8)
    llm = LLM(tiny.store("qwen4_exp", **overrides), device="cuda", dtype="bfloat16", ngram_tier=tier)
    try:
        assert llm.stats()["ngram"]["tier"] == tier
        ids = prompt(40, seed=5).tolist()  # past the budget (8): every query chooses its blocks
        replays = llm.decoder.graph_replays  # the load replays the graph once
        tokens, logits = greedy_trace(llm, ids, STEPS)
        assert llm.decoder.graph_replays - replays == STEPS
        with torch.inference_mode():  # the eager forward, one token at a time, fed the same tokens
            state = llm.model.new_state(llm.dtype, llm.device)
            llm.model(torch.tensor(ids, device="cuda"), state)
            eager = torch.cat([llm.model.logits(llm.model(torch.tensor([t], device="cuda"), state)) for t in tokens])
        eager, graphed = eager.cpu(), logits[len(ids):]  # the rows each decode step returned
        assert (graphed - eager).abs().max() < 2e-2 * eager.abs().max()
        assert tokens[1:] == eager[:-1].argmax(-1).tolist()
        reference = hf_logits(tiny.dequantized("qwen4_exp", **overrides), torch.tensor(ids + tokens[:-1]))
        reference = reference[len(ids) - 1:]
        top2 = reference.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * reference.abs().max()  # argmax not decided by bf16 rounding
        assert clear.sum() >= STEPS // 2
        assert torch.equal(reference.argmax(-1)[clear], torch.tensor(tokens)[clear])
        assert llm.stats()["ngram"]["reads"][tier]["rows"] > 0
    finally:
        llm.close()
