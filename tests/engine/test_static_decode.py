"""The static decode step (the one CUDA graphs capture) equals the model's own eager forward, step by step. On
the CPU it runs with the routing handshake: the same layers, masks and caches as on the GPU."""

import dataclasses

import pytest
import torch

from moestream.engine.decode import Decoder
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams
from tests.conftest import MODEL_TYPES
from tests.engine.runs import prompt_of, static_hyper_store


@torch.inference_mode()
def _compare(llm: LLM, steps: int = 6) -> None:
    prompt = prompt_of(llm, 12)
    cfg = dataclasses.replace(llm.engine_config, max_context=16, decode_mode="handshake")  # grows past 16
    decoder = Decoder(llm.model, llm.provider, cfg, llm.device, llm.dtype, static=True)
    plain, static = llm.model.new_state(llm.dtype, llm.device), decoder.new_state()
    for state in (plain, static):
        llm.model(torch.tensor(prompt), state)
    token = prompt[-1]
    for _ in range(steps):
        want = llm.model.logits(llm.model(torch.tensor([token]), plain))[0]
        got = decoder.step(token, static)
        assert (got - want).norm() / want.norm() < 1e-4
        token = int(torch.argmax(want))
    assert static.length == plain.length and static.tokens == plain.tokens
    # a cache grown past its first capacity is made anew (the capacity sets the attention's split); every
    # sequence after that one gets the same buffers
    again = decoder.new_state()
    assert again.length == 0 and all(c.capacity == 64 for c in again.caches)
    assert decoder.new_state() is again


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t != "qwen4_exp"])
def test_static_step_equals_forward(tiny, model_type):
    llm = LLM(tiny.store(model_type), device="cpu", dtype="float32")
    try:
        _compare(llm)
    finally:
        llm.close()


def test_static_step_with_hyper_connections(tmp_path):
    """qwen4_exp without PLE layers and indexed attention: the streams stand where the residual does."""
    llm = LLM(static_hyper_store(str(tmp_path / "flash-next")), device="cpu", dtype="float32")
    try:
        _compare(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_static_step_with_ple_and_indexed_attention(tiny, tier):
    """qwen4_exp with a PLE layer and QSA past its budget (8 tokens): every query chooses among blocks. With the
    n-gram table on the host tier the step reads its rows in place; on disk they are staged before it. Eight index
    heads make exact score ties (which the static step breaks by block index, the eager one as transformers does)
    unlikely."""
    llm = LLM(tiny.store("qwen4_exp", indexer_n_heads=8), device="cpu", dtype="float32", ngram_tier=tier)
    try:
        _compare(llm, steps=10)
    finally:
        llm.close()


def test_two_indexed_attention_layers_grow_past_their_first_capacity(tiny):
    """The row map is the sequence's: the first QSA layer grows it, and the next still grows its indexer keys."""
    store = tiny.store("qwen4_exp", layer_types=["linear_attention", "indexed_attention"] * 2)
    answers = []
    for max_batch in (1, 16):  # the eager state (capacity 64) and the static one (max_context 32)
        llm = LLM(store, device="cpu", dtype="float32", max_batch=max_batch, max_context=32)
        try:
            answers.append(llm.generate([prompt_of(llm, 100)], SamplingParams(max_tokens=4))[0].token_ids)
        finally:
            llm.close()
    assert answers[0] == answers[1]
