"""The package's trained demo model (`moestream/demo_model`) against transformers: its Q4 experts dequantized
into a Hugging Face checkpoint that transformers loads unchanged, and the same greedy tokens on CPU and GPU."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams
from tests.models.oracle import assert_logits_close, dequantize_experts, hf_logits
from tests.packer.helpers import load_manifest

PROMPT = "The module defines a new type, function, or method, which can be used to"


def test_the_demo_model_ships_its_mtp_head():
    m = json.load(open(os.path.join(DEMO_STORE, "manifest.json")))
    assert m["config"]["mtp_num_hidden_layers"] == 1
    assert load_manifest(DEMO_STORE).geometry.layer_ids[-1] == -1  # the MTP layer's experts: one more record layer
    assert "mtp.fc.weight" in load_file(os.path.join(DEMO_STORE, "dense.safetensors"))


def test_the_demo_models_logits_equal_transformers(tmp_path):
    llm = LLM(DEMO_STORE, device="cpu", dtype="float32")
    ids = torch.tensor(llm.tokenizer.encode(PROMPT * 4))
    ref = hf_logits(dequantize_experts(DEMO_STORE, DEMO_STORE, str(tmp_path / "hf")), ids)
    assert_logits_close(llm.logits(ids), ref)
    llm.close()


def greedy(device: str, dtype: str | None = None) -> list[int]:
    llm = LLM(DEMO_STORE, device=device, dtype=dtype,
              pool_gb=56 * load_manifest(DEMO_STORE).layouts["q4"].stride / 1e9 * 1.0001)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=48, temperature=0))[0].token_ids
    llm.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_dtype", ["bfloat16", "float32"])
def test_the_demo_model_gives_the_same_greedy_tokens_on_cpu_and_gpu(gpu_dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert greedy("cuda", gpu_dtype) == greedy("cpu")
