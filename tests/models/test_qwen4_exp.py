"""qwen4_exp against transformers: hyper-connections, PLE n-gram embeddings and QSA indexed attention on
tiny random configs (fp32 on the same bf16 checkpoint), prefill + steps, and configs we refuse."""

import json
import os
import shutil

import pytest
import torch

from moestream.config import ModelConfig
from moestream.engine.llm import LLM
from moestream.errors import UnsupportedModelError
from tests.models.oracle import assert_logits_close, dequantize_experts, hf_logits

EOS = 1
LINEAR, FULL = "linear_attention", "full_attention"
# Budgets (8, 16) sit well below the prompts (60-100 tokens), so the indexer's choice shapes the logits.
VARIANTS = {
    "base": dict(),  # hc 2, PLE on layer 1, 2 indexer heads, budget 8 / ratio 4, GQA 4:2
    "hc4-gqa8": dict(hc_count=4, hc_lowrank=32, ple_layer_ids=[2, 3], ngram_size=4, heads_per_ngram=2,
                     ple_embed_dim=96, ple_conv_kernel_size=3, num_attention_heads=8, num_key_value_heads=1,
                     indexer_n_heads=1, output_gate_type="sigmoid"),  # 1 indexer head: many tied block scores
    "hc3-no-ple": dict(hc_count=3, ple_layer_ids=[], layer_types=[FULL, LINEAR, FULL, LINEAR],
                       num_attention_heads=2, num_key_value_heads=2, indexer_n_heads=4, indexer_head_dim=32,
                       indexer_budget=16, indexer_compress_ratio=8,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    # No indexer fields: plain gated attention. The oracle is the same weights with a budget above every prompt.
    "no-indexer": dict(hc_count=4, ple_layer_ids=[1, 3], layer_types=[LINEAR, FULL, LINEAR, FULL],
                       indexer_budget=128),
}


def prompt(length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(seed))
    ids[[0, 9, 10, 31, length // 2, length - 3]] = EOS  # n-grams restart after EOS, including back to back
    return ids


def plain_attention_copy(src: str) -> str:
    """`src` without the indexer fields and tensors: a config whose attention layers are plain gated."""
    from safetensors.torch import save_file

    from tests.packer.helpers import source_tensors

    out = src + "-plain"
    if not os.path.isdir(out):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        for key in [k for k in cfg if k.startswith("indexer_")]:
            del cfg[key]
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)
        tensors = {k: v for k, v in source_tensors(src).items() if ".indexer." not in k}
        save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def store_and_oracles(tiny, variant: str) -> tuple[str, str, str]:
    """(our store, transformers checkpoint for bf16 experts, transformers checkpoint for Q4 experts)."""
    overrides = VARIANTS[variant]
    if variant != "no-indexer":
        return (tiny.store("qwen4_exp", **overrides), tiny.checkpoint("qwen4_exp", **overrides),
                tiny.dequantized("qwen4_exp", **overrides))
    from moestream.packer.pack import PackOptions, pack

    src = tiny.checkpoint("qwen4_exp", **overrides)
    store, dequantized = src + "-plain-store", src + "-dequantized"
    if not os.path.isdir(store):
        pack(plain_attention_copy(src), store, PackOptions(precisions=("q4", "bf16"), show_progress=False))
        dequantize_experts(src, store, dequantized)
    return store, src, dequantized


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("experts", [16, 4])
def test_logits_match_transformers(tiny, variant, experts):
    store, exact, dequantized = store_and_oracles(tiny, variant)
    llm = LLM(store, device="cpu", dtype="float32", experts=experts)
    assert llm.config.indexer_budget == (0 if variant == "no-indexer" else VARIANTS[variant].get("indexer_budget", 8))
    ids = prompt(60 + 13 * list(VARIANTS).index(variant), seed=experts)
    ref = hf_logits(exact if experts == 16 else dequantized, ids)
    rel = assert_logits_close(llm.logits(ids), ref)
    print(f"qwen4_exp {variant} experts={experts}: max relative error {rel:.2e}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_steps_equals_one_forward(tiny, variant):
    llm = LLM(store_and_oracles(tiny, variant)[0], device="cpu", dtype="float32", experts=16)
    ids = prompt(64, seed=3)
    full = llm.logits(ids)
    state = llm.model.new_state(llm.dtype, llm.device)
    with torch.inference_mode():
        parts = [llm.model.logits(llm.model(ids[:5], state))]  # shorter than the budget: steps cross it
        parts.append(llm.model.logits(llm.model(ids[5:21], state)))
        copy = llm.model.new_state(llm.dtype, llm.device)
        copy.load(state.snapshot())
        for t in range(21, 64):
            parts.append(llm.model.logits(llm.model(ids[t:t + 1], state)))
        resumed = llm.model.logits(llm.model(ids[21:], copy))
    assert_logits_close(torch.cat(parts), full, rel=1e-5)
    assert_logits_close(resumed, full[21:], rel=1e-5)


def base_config(tiny) -> dict:
    with open(os.path.join(tiny.checkpoint("qwen4_exp"), "config.json")) as f:
        return json.load(f)


REFUSED = {
    "output_gate_type": (dict(output_gate_type="gelu"), "output_gate_type"),
    "ple on attention": (dict(ple_layer_ids=[4]), "linear_attention"),
    "ple out of range": (dict(ple_layer_ids=[0]), "one-based"),
    "ple heads": (dict(ple_embed_dim=62), "ple_embed_dim"),
    "ple without eos": (dict(eos_token_id=None), "eos_token_id"),
    "indexer missing": (dict(indexer_budget=None), "indexer_budget"),
    "indexer kv heads": (dict(indexer_kv_heads=2), "indexer_kv_heads"),
    "indexer budget": (dict(indexer_budget=10), "multiple"),
    "indexer rope": (dict(indexer_head_dim=2), "rotary"),
    "indexed without indexer": (dict(layer_types=[LINEAR] * 3 + ["indexed_attention"], indexer_n_heads=None,
                                     indexer_kv_heads=None, indexer_head_dim=None, indexer_budget=None,
                                     indexer_compress_ratio=None), "indexer_"),
    "one stream": (dict(hc_count=1), "hc_count"),
    "dense layers": (dict(mlp_only_layers=[0]), "every layer"),
    "rope scaling": (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configs_are_refused_in_one_line(tiny, case):
    changes, words = REFUSED[case]
    cfg = {**base_config(tiny), **changes}
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_hf(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_config_fields(tiny):
    cfg = ModelConfig.from_hf(base_config(tiny))
    assert cfg.ple_layer_ids == (0,) and cfg.layer_types[3] == "indexed_attention"
    assert cfg.output_gate_type == "silu"  # unset: falls back to hidden_act, as transformers does
    assert not ModelConfig.from_hf({**base_config(tiny), "norm_topk_prob": False}).norm_topk_prob


@pytest.mark.gpu
@pytest.mark.interpretable
def test_triton_hyper_connections_match_the_reference(tiny, monkeypatch):
    """Prefill, then greedy decode steps, with the hyper-connection ops (grouped norms, injection + norm, the mix)
    on Triton and every other op on the reference: the same tokens and logits as all-reference. hc 4 with PLE on
    layers after the first, so a pending injection also lands in a PLE query norm. CUDA, or CPU under
    TRITON_INTERPRET=1 (fp32 there)."""
    pytest.importorskip("triton")
    from moestream.kernels import ops

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    llm = LLM(tiny.store("qwen4_exp", **VARIANTS["hc4-gqa8"]), device=device, dtype="float32", experts=16)
    monkeypatch.setattr(ops, "KERNELS", "reference")

    def on_triton(op):
        def call(*args):
            ops.KERNELS = "triton"
            try:
                return op(*args)
            finally:
                ops.KERNELS = "reference"
        return call

    @torch.inference_mode()
    def greedy(steps: int = 4):
        state, tokens, logits = llm.model.new_state(llm.dtype, llm.device), [], []
        last = llm.model.logits(llm.model(prompt(40, seed=5).to(llm.device), state))[-1]
        for _ in range(steps):
            tokens.append(int(last.argmax()))
            last = llm.model.logits(llm.model(torch.tensor(tokens[-1:], device=llm.device), state))[0]
            logits.append(last)
        return tokens, torch.stack(logits)

    want_tokens, want = greedy()
    for name in ("grouped_rms_norm", "inject_rms_norm", "hyper_mix"):
        monkeypatch.setattr(ops, name, on_triton(getattr(ops, name)))
    tokens, got = greedy()
    assert tokens == want_tokens
    assert_logits_close(got, want, rel=1e-5)
