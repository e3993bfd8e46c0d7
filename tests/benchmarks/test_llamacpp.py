"""The llama.cpp peer's GGUF reads back as llama.cpp's qwen3moe expects it (keys, tensor names, GGML types and
ne shapes, a padded gpt2 vocabulary), and llama-bench's JSON turns into rows."""

import json

import numpy as np
import pytest

from benchmarks import llamacpp

gguf = pytest.importorskip("gguf")

TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# a byte-level BPE in miniature: two merges, a special and a non-special added token, ids 0..5 of 16
MINI_TOKENIZER = {
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġab": 3}, "merges": [["a", "b"], ["Ġ", "ab"]]},
    "added_tokens": [{"id": 4, "content": "<|im_end|>", "special": True},
                     {"id": 5, "content": "<think>", "special": False}],
}


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def test_a_tiny_gguf_has_qwen3moe_keys_tensors_and_vocab(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps(MINI_TOKENIZER))
    path = tmp_path / "tiny.gguf"
    llamacpp.write_gguf(path, layers=2, tokenizer_json=tok, progress=False, vocab_size=16, **TINY)
    reader = gguf.GGUFReader(path)
    kv = _fields(reader)
    assert kv["general.architecture"] == "qwen3moe"
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    expected = {"block_count": 2, "embedding_length": 64, "attention.head_count": 2, "attention.head_count_kv": 1,
                "attention.key_length": 32, "expert_count": 4, "expert_used_count": 2,
                "expert_feed_forward_length": 32, "context_length": 40960}
    assert {k: kv[f"qwen3moe.{k}"] for k in expected} == expected
    assert kv["qwen3moe.rope.freq_base"] == 1e6
    assert kv["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    assert kv["tokenizer.ggml.tokens"] == ["a", "b", "ab", "Ġab", "<|im_end|>", "<think>"] + [
        f"[PAD{i}]" for i in range(6, 16)]
    T = gguf.TokenType
    assert kv["tokenizer.ggml.token_type"] == [T.NORMAL] * 4 + [T.CONTROL, T.USER_DEFINED] + [T.UNUSED] * 10
    assert kv["tokenizer.ggml.merges"] == ["a b", "Ġ ab"]
    assert kv["tokenizer.ggml.eos_token_id"] == 4 and "tokenizer.ggml.bos_token_id" not in kv

    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 2 * 12
    shapes = {  # GGML ne order, as llama-model.cpp's create_tensor names them
        "token_embd.weight": ("F16", [64, 16]), "output.weight": ("F16", [64, 16]),
        "output_norm.weight": ("F32", [64]), "blk.1.attn_q.weight": ("F16", [64, 64]),
        "blk.1.attn_k.weight": ("F16", [64, 32]), "blk.1.attn_output.weight": ("F16", [64, 64]),
        "blk.1.attn_k_norm.weight": ("F32", [32]), "blk.1.ffn_gate_inp.weight": ("F32", [64, 4]),
        "blk.1.ffn_gate_exps.weight": ("Q4_0", [64, 32, 4]), "blk.1.ffn_up_exps.weight": ("Q4_0", [64, 32, 4]),
        "blk.1.ffn_down_exps.weight": ("Q4_0", [32, 64, 4]),
    }
    assert {n: (tensors[n].tensor_type.name, tensors[n].shape.tolist()) for n in shapes} == shapes
    down = gguf.dequantize(tensors["blk.1.ffn_down_exps.weight"].data, gguf.GGMLQuantizationType.Q4_0)
    assert np.isfinite(down).all() and 0 < np.abs(down).max() <= 8 * 4 * llamacpp.EXPERT_SCALE["ffn_down_exps"]
    assert (np.asarray(tensors["blk.0.attn_norm.weight"].data) == 1).all()


@pytest.mark.slow  # GGUFReader takes ~7 s over 300k strings
@pytest.mark.skipif(not llamacpp.TOKENIZER_JSON.exists(), reason="no Qwen3 tokenizer in .device/")
def test_the_real_tokenizer_pads_to_the_geometry_vocab(tmp_path):
    path = tmp_path / "vocab.gguf"
    llamacpp.write_gguf(path, layers=1, progress=False, **TINY)
    fields = gguf.GGUFReader(path).fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 151936 and tokens.contents(-1) == "[PAD151935]"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 151645
    assert fields["tokenizer.ggml.padding_token_id"].contents() == 151643


# llama-bench -m 2-layer.gguf -p 64 -n 8 -ngl 99 -fa 1 -r 2 -ncmoe 0,1 -o json on a 2-core CPU (fields trimmed)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown", "backends": "CPU", "model_type": "qwen3moe ?B Q4_0", "n_gpu_layers": 99,
    "n_cpu_moe": 0, "flash_attn": 1, "n_prompt": 0, "n_gen": 8, "n_depth": 0,
    "avg_ns": 219971324, "stddev_ns": 2947645, "avg_ts": 36.371642, "stddev_ts": 0.487373,
    "samples_ns": [ 222055572, 217887077 ],
    "samples_ts": [ 36.027, 36.7163 ]
  },
  {
    "build_commit": "unknown", "backends": "CPU", "model_type": "qwen3moe ?B Q4_0", "n_gpu_layers": 99,
    "n_cpu_moe": 1, "flash_attn": 1, "n_prompt": 64, "n_gen": 0, "n_depth": 0,
    "avg_ns": 100860600, "stddev_ns": 1180755, "avg_ts": 634.582641, "stddev_ts": 7.428934,
    "samples_ns": [ 100025680, 101695520 ],
    "samples_ts": [ 639.836, 629.33 ]
  }
]
"""


def test_llama_bench_json_becomes_rows():
    assert llamacpp.parse_bench(json.loads(LLAMA_BENCH_JSON)) == [
        {"scenario": "gpu", "test": "tg8", "tok_s": 36.371642, "stddev": 0.487373},
        {"scenario": "n_cpu_moe=1", "test": "pp64", "tok_s": 634.582641, "stddev": 7.428934},
    ]


def test_bench_rows_join_the_suite_beside_ours():
    from benchmarks.report import PEERS, table

    rows = llamacpp.suite_rows([{"scenario": "gpu", "test": "tg128", "tok_s": 90.0, "stddev": 1.0},
                                {"scenario": "n_cpu_moe=36", "test": "pp512", "tok_s": 2000.0, "stddev": 9.0}])
    assert [(r["engine"], r["scenario"], r["tokens"], r["pool"]) for r in rows] == [
        ("llama.cpp (GPU)", "decode", 16, 1.0), ("llama.cpp --n-cpu-moe 36", "prefill", 512, 0.25)]
    assert {r["engine"] for r in rows} <= set(PEERS)
    ours = {"model": "qwen3-30b", "engine": "moestream", "pool": 0.25, "host_tier": True, "scenario": "prefill",
            "tokens": 512, "rate": 1500.0}
    assert table(rows + [ours], "qwen3-30b")[-1].endswith("| - | - | - | 2,000.0 | - |")
    unpacked = llamacpp.suite_rows([{"scenario": "n_cpu_moe=36", "test": "pp512", "tok_s": 2500.0, "stddev": 9.0}],
                                   " " + " ".join(llamacpp.NO_REPACK))
    assert table(rows + unpacked + [ours], "qwen3-30b")[-1].endswith("| 2,000.0 | 2,500.0 |")
