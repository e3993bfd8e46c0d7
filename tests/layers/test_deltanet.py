"""A tiny hybrid model's decode steps with its DeltaNet layers on the Triton step (every other op on its
usual dispatch) give the greedy tokens and, closely, the logits of the reference path: both projection layouts,
silu and sigmoid output gates, prefill on the reference then the states chained through the kernels. Runs on
CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.kernels import ops, reference
from moestream.layers.deltanet import GatedDeltaNet

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
STEPS = 6


@torch.inference_mode()
def greedy(llm: LLM, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    state = llm.model.new_state(llm.dtype, llm.device)
    logits = llm.model.logits(llm.model(prompt, state))[-1:]
    tokens, rows = [], []
    for _ in range(STEPS):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = llm.model.logits(llm.model(torch.tensor([tokens[-1]], device=llm.device), state))
    return tokens, torch.cat(rows)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_next", "qwen4_exp"])
def test_decode_with_the_triton_deltanet_step_matches_reference(tiny, monkeypatch, model_type):
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    dispatch, launch, launched = ops.deltanet_step, deltanet.deltanet_step, []

    def triton_deltanet_step(*args):  # the dispatcher with Triton chosen, for this op only
        with monkeypatch.context() as patch:
            patch.setattr(ops, "KERNELS", "triton")
            return dispatch(*args)

    # only this op on the reference: on CUDA the other ops must stay graph-safe (LLM captures at load)
    monkeypatch.setattr(ops, "deltanet_step", reference.deltanet_step)
    monkeypatch.setattr(deltanet, "deltanet_step", lambda *args: launched.append(1) or launch(*args))
    llm = LLM(tiny.store(model_type), device=DEVICE, dtype="float32", experts=16)
    try:
        prompt = torch.randint(0, llm.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
        want_tokens, want = greedy(llm, prompt.to(llm.device))
        assert not launched
        monkeypatch.setattr(ops, "deltanet_step", triton_deltanet_step)
        got_tokens, got = greedy(llm, prompt.to(llm.device))
        layers = sum(isinstance(m, GatedDeltaNet) for m in llm.model.modules())
    finally:
        llm.close()
    assert layers and len(launched) == STEPS * layers  # every decode step's layer, not the prefill
    assert got_tokens == want_tokens
    assert (got - want).norm() / want.norm() < 1e-5
