"""Config fields that change the math are honoured or refused at load with one clear line."""

import pytest

from moestream.config import ModelConfig
from moestream.errors import UnsupportedModelError
from moestream.tiny import tiny_config


def hf(model_type: str, **overrides) -> dict:
    return tiny_config(model_type, **overrides).to_dict()


@pytest.mark.parametrize("change,message", [
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope type 'yarn'"),
    (dict(model_type="llama"), "unsupported model_type 'llama'"),
    (dict(num_experts=0), "no routed experts"),
])
def test_refused(change, message):
    cfg = hf("qwen3_moe")
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(cfg)


def test_honoured_fields():
    c = ModelConfig.from_hf(hf("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[1], attention_bias=True,
                               norm_topk_prob=False, tie_word_embeddings=True))
    assert c.moe_layers == (False, False, False, True) and c.qkv_bias and c.o_bias
    assert not c.norm_topk_prob and c.tie_word_embeddings
    q2 = ModelConfig.from_hf(hf("qwen2_moe"))
    assert q2.qkv_bias and not q2.o_bias and q2.shared_expert_intermediate_size == 64
    nxt = ModelConfig.from_hf(hf("qwen3_next"))
    assert nxt.partial_rotary_factor == 0.25 and nxt.layer_types[3] == "full_attention"


def test_multimodal_text_config_is_read():
    text = hf("qwen3_5_moe")
    wrapped = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 2}}
    assert ModelConfig.from_hf(wrapped) == ModelConfig.from_hf(text)
