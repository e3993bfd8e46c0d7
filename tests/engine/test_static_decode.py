"""The static decode step (the one CUDA graphs capture) equals the model's own forward, step by step. On
the CPU it runs with the routing handshake: the same layers, masks and caches as on the GPU."""

import pytest
import torch

from moestream.engine.decode import STATIC_TYPES, CudaDecoder, supports_static_decode
from moestream.engine.llm import LLM
from tests.engine.runs import prompt_of, static_hyper_store


@torch.inference_mode()
def _compare(llm: LLM, steps: int = 6) -> None:
    prompt = prompt_of(llm, 12)
    states = [llm.model.new_state(llm.dtype, llm.device) for _ in range(2)]
    for state in states:
        llm.model(torch.tensor(prompt), state)
    decoder = CudaDecoder(llm.model, llm.provider, max_context=16, mode="handshake")  # grows past 16
    token = prompt[-1]
    for _ in range(steps):
        want = llm.model.logits(llm.model(torch.tensor([token]), states[0]))[0]
        got = decoder.step(token, states[1])
        assert (got - want).norm() / want.norm() < 1e-4
        token = int(torch.argmax(want))


@pytest.mark.parametrize("model_type", [t for t in STATIC_TYPES if t != "qwen4_exp"])
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
        assert supports_static_decode(llm.model)
        _compare(llm)
    finally:
        llm.close()


def test_qwen4_exp_with_ple_and_indexed_attention_decodes_eagerly(tiny):
    llm = LLM(tiny.store("qwen4_exp"), device="cpu")
    try:
        assert not supports_static_decode(llm.model)
    finally:
        llm.close()
