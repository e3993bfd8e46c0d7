"""test_batching.py on CUDA (bf16): batched steps replay their own graphs and keep every request's tokens."""

import pytest
import torch

from moestream.engine.llm import LLM
from tests.conftest import MODEL_TYPES
from tests.engine.runs import static_hyper_store
from tests.engine.test_batching import GREEDY, _arriving, _prompts, _quarter_pool

pytestmark = pytest.mark.gpu

SETTINGS = {"resident": {}, "resident, prompts on some SMs": dict(prefill_sms="auto"), "25% pool + host": "quarter",
            "25% pool + disk": "quarter, no host", "handshake": dict(decode_mode="handshake")}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "qwen4_exp_static"])
def test_gpu_eight_requests_together_get_the_tokens_each_gets_alone(tiny, tmp_path, model_type, setting):
    store = static_hyper_store(str(tmp_path / "s")) if model_type == "qwen4_exp_static" else tiny.store(model_type)
    options = SETTINGS[setting]
    if isinstance(options, str):
        options = _quarter_pool(store) | ({"host_gb": 0} if "no host" in options else {})
    llm = LLM(store, device="cuda", **options)
    try:
        prompts = _prompts(llm)
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        replays = llm.decoder.graph_replays
        together = [out.token_ids for out in llm.generate(prompts, GREEDY)]  # into an idle engine: all at once
        graphed = (8, True) in llm.decoder.graphs and llm.decoder.graph_replays > replays
        arriving = _arriving(llm, prompts)
        aside = llm.prefiller.aside  # prompts replayed beside the decoding steps
        expect_graphs = setting.startswith("resident") or setting == "25% pool + host"  # every record addressable
    finally:
        llm.close()
        torch.cuda.empty_cache()
    assert together == alone and arriving == alone
    assert graphed == expect_graphs
    assert (aside > 0) == (setting.startswith("resident") and model_type in ("qwen3_moe", "qwen2_moe"))


def test_gpu_batches_past_the_reserved_context_keep_their_tokens(tiny):
    """Slots grow past max_context in a batch (the graphs are captured anew over the grown buffers), and are made
    anew for the next requests (graphs over freed buffers must never replay)."""
    llm = LLM(tiny.store("qwen3_moe"), device="cuda", max_context=16)  # prompts of 3-18 tokens, 10 more each
    try:
        prompts = _prompts(llm, 4)
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        for _ in range(2):
            assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == alone
    finally:
        llm.close()
        torch.cuda.empty_cache()


def test_gpu_every_batch_size_is_captured_at_load_and_no_request_captures(tiny, monkeypatch):
    """A first-use capture stalls every running sequence for a step (~0.1 s on the 30B): the load captures them all."""
    llm = LLM(tiny.store("qwen3_moe"), device="cuda")
    try:
        assert all((rows, True) in llm.decoder.graphs for rows in range(2, llm.max_batch + 1))
        captures, capture = [], llm.decoder._capture
        monkeypatch.setattr(llm.decoder, "_capture", lambda *args: (captures.append(args[0]), capture(*args)))
        prompts = _prompts(llm, 5)
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        replays = llm.decoder.graph_replays
        together = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        replayed = llm.decoder.graph_replays - replays
    finally:
        llm.close()
        torch.cuda.empty_cache()
    assert together == alone and captures == [] and replayed >= GREEDY.max_tokens - 1  # the first token is the prompt's
