"""Each model type against transformers, on tiny random configs (fp32 on the same bf16 checkpoint)."""

import pytest
import torch

from moestream.engine.llm import LLM
from tests.models.oracle import assert_logits_close, hf_logits

FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe")
VARIANTS = {
    "qwen3_moe": [dict(), dict(num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=3),
                  dict(decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=False),
                  dict(tie_word_embeddings=True, hidden_size=128, num_experts=16, num_experts_per_tok=4),
                  dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5})],
    "qwen2_moe": [dict(), dict(num_attention_heads=8, num_key_value_heads=8, norm_topk_prob=True),
                  dict(mlp_only_layers=[1, 2], decoder_sparse_step=1)],
    "qwen3_next": [dict(), dict(linear_num_value_heads=2, num_key_value_heads=4),
                   dict(layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
                        mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                              "partial_rotary_factor": 0.5})],
    "qwen3_5_moe": [dict(), dict(linear_num_key_heads=4, linear_num_value_heads=8, num_experts=16,
                                 num_experts_per_tok=3, num_hidden_layers=5,
                                 layer_types=["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2)],
}
CASES = [(mt, i) for mt in FAMILIES for i in range(len(VARIANTS[mt]))]


@pytest.mark.parametrize("model_type,variant", CASES)
@pytest.mark.parametrize("experts", [16, 4])
def test_logits_match_transformers(tiny, model_type, variant, experts):
    overrides = VARIANTS[model_type][variant]
    store = tiny.store(model_type, **overrides)
    llm = LLM(store, device="cpu", dtype="float32", experts=experts)
    ids = torch.randint(0, llm.config.vocab_size, (37,), generator=torch.Generator().manual_seed(variant))
    if experts == 16:
        ref = hf_logits(tiny.checkpoint(model_type, **overrides), ids)
    else:
        ref = hf_logits(tiny.dequantized(model_type, **overrides), ids)
    assert_logits_close(llm.logits(ids), ref)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prefill_then_steps_equals_one_forward(tiny, model_type):
    llm = LLM(tiny.store(model_type), device="cpu", dtype="float32", experts=16)
    ids = torch.randint(0, llm.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    full = llm.logits(ids)
    state = llm.model.new_state(llm.dtype, llm.device)
    with torch.inference_mode():
        parts = [llm.model.logits(llm.model(ids[:17], state))]
        for t in range(17, 24):
            parts.append(llm.model.logits(llm.model(ids[t:t + 1], state)))
    assert_logits_close(torch.cat(parts), full, rel=1e-5)
