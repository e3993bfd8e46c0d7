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


def test_engine_config_takes_overrides_by_name_and_checks_them():
    from moestream.config import EngineConfig, ExpertConfig
    from moestream.errors import ConfigError

    cfg = EngineConfig(max_context=64).with_overrides(pool_gb=2.5, experts=16, miss_experts=None, prefill_chunk=8)
    assert (cfg.max_context, cfg.prefill_chunk, cfg.expert.pool_gb, cfg.expert.precision) == (64, 8, 2.5, "bf16")
    assert cfg.with_overrides(prefill_sms="auto").prefill_sms == "auto"
    for bad in (dict(pool_gb=float("nan")), dict(host_gb=-1.0), dict(ring_group=0), dict(experts=5),
                dict(experts=2, miss_experts=3), dict(decode_mode="fast"), dict(prefix_cache_mb=-1.0),
                dict(prefill_sms=-1), dict(prefill_sms="most"), dict(prefill_graph_tokens=1000),
                dict(prefill_graph_tokens=256), dict(no_such_option=1)):
        with pytest.raises(ConfigError):
            EngineConfig().with_overrides(**bad)
    with pytest.raises(ConfigError, match="io_timeout_s"):
        ExpertConfig(io_timeout_s=0)


def test_llm_takes_a_config_and_keyword_overrides(tiny):
    from moestream.config import EngineConfig
    from moestream.engine.llm import LLM

    llm = LLM(tiny.store("qwen3_moe"), EngineConfig(device="cpu", prefill_chunk=8), ring_group=2)
    try:
        cfg = llm.engine_config
        assert (cfg.device, cfg.dtype, cfg.prefill_chunk, cfg.expert.ring_group, cfg.expert.precision) == \
            ("cpu", "float32", 8, 2, "q4")
    finally:
        llm.close()
