"""The MTP head (models/mtp.py) of the trained demo model against its training-time module in transformers'
layers (training/model.py, the checkpoint layout's oracle), and its drafts on real text."""

import os

import pytest
import torch
from safetensors.torch import load_file

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from tests.models.oracle import assert_logits_close, dequantize_experts, hf_model

TEXT = ("The module defines a new type, function, or method, which can be used to build a parser. "
        "Each call returns a new object; the object holds the state of the parse and the tokens read so far.")


@pytest.fixture(scope="module")
def demo():
    llm = LLM(DEMO_STORE, device="cpu", dtype="float32", speculation="mtp")
    yield llm
    llm.close()


@torch.inference_mode()
def mtp_logits(llm: LLM, ids: torch.Tensor) -> torch.Tensor:
    """The head's guesses at x[t+2] for t = 0..T-2, from one prefill of x[0..T-1] (both states eager)."""
    model = llm.model
    hidden = model(ids, model.new_state(llm.dtype, llm.device))
    drafted = model.draft(hidden[:-1], ids[1:], model.mtp.new_state(llm.dtype, llm.device))
    return model.draft_logits(drafted)


def test_the_demo_models_mtp_head_equals_its_training_module(demo, tmp_path):
    from training.model import build, joint_forward, load_mtp_tensors

    ids = torch.tensor(demo.tokenizer.encode(TEXT))
    path = dequantize_experts(DEMO_STORE, DEMO_STORE, str(tmp_path / "hf"))
    trunk = hf_model(path)
    _, mtp = build(trunk.config)
    load_mtp_tensors(mtp, load_file(os.path.join(path, "model.safetensors")))
    with torch.inference_mode():
        want = joint_forward(trunk, mtp.eval(), ids[None])[1][0].float()  # x[t+2] from x[0..T-2]
    assert_logits_close(mtp_logits(demo, ids)[:-1], want)


def test_the_mtp_heads_drafts_match_the_trunks_greedy_tokens_on_text(demo):
    """On text the model was trained for, the head's argmax at t agrees with the trunk's own argmax at t+1 (what
    greedy speculation accepts) far above chance (1/4096)."""
    ids = torch.tensor(demo.tokenizer.encode(TEXT))
    with torch.inference_mode():
        trunk = demo.model.logits(demo.model(ids, demo.model.new_state(demo.dtype, demo.device))).argmax(-1)
    drafts = mtp_logits(demo, ids).argmax(-1)  # at t: a guess at x[t+2], which the trunk predicts at t+1
    agree = (drafts == trunk[1:]).float().mean().item()
    assert agree > 0.2, agree
