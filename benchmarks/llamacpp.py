"""llama.cpp as a peer: a GGUF of a suite geometry from random weights, and `llama-bench` run on it.

`write_gguf` writes llama.cpp's `qwen3moe` architecture (tensor names, shapes and keys as its
convert_hf_to_gguf.py writes them for Qwen3-MoE) with the geometry of `synthetic.GEOMETRIES`: routed experts
as Q4_0 blocks (random nibbles, small fp16 scales), other matrices F16, norms and routers F32 (llama.cpp's
convert and quantize keep routers F32). Magnitudes follow `synthetic.build`'s store (a large embedding, small
block outputs, its expert scales), which keeps random routing diverse over 48 layers. The vocabulary is
the real Qwen3 tokenizer.json (gpt2 BPE, pre-tokenizer "qwen2", padded with `[PADi]` to `vocab_size`).
Tensors are generated and written one at a time (memory stays near the largest tensor, not the ~19 GB file).

`bench` runs `llama-bench -p 512,4096 -n 128 -ngl 99 -fa 1 -o json` (one run per `--n-cpu-moe` value: the
experts of the first N layers stay in CPU RAM) and turns its JSON into rows {scenario, test, tok_s, stddev}.
The binary comes from benchmarks/llamacpp_build.sh, its sources from benchmarks/llamacpp_slim.sh.

python -m benchmarks.llamacpp gguf OUT.gguf [--layers N] [--tokenizer tokenizer.json[.gz]]
python -m benchmarks.llamacpp bench BINARY GGUF OUT.json [--n-cpu-moe 0,36] [--reps 5] [--prompts 512,4096]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.synthetic import BLOCK_OUT_SCALE, EMBED_SCALE, GEOMETRIES

TOKENIZER_JSON = Path(__file__).resolve().parents[1] / ".device" / "qwen3-tokenizer.json.gz"
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # values per block; fp16 scale + 16 bytes of nibbles
# Qwen3's ids as its tokenizer_config.json / config.json name them (bos = <|endoftext|>, as convert writes it)
SPECIAL = {"eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": "<|endoftext|>"}
# Q4_0 scales in [s, 4s): around the synthetic store's expert scales (0.002 gate/up, 0.0005 down)
EXPERT_SCALE = {"ffn_gate_exps": 2**-10, "ffn_up_exps": 2**-10, "ffn_down_exps": 2**-12}


def tensor_specs(hf: dict) -> list[tuple[str, tuple[int, ...], str, float | None]]:
    """(name, numpy shape, type, scale) in file order. numpy shapes are GGML's ne reversed: llama.cpp's
    `{n_embd, n_vocab}` is (vocab, hidden) here. `scale`: typical magnitude, Q4_0 scale, None for ones (norms)."""
    h, v, e, f = hf["hidden_size"], hf["vocab_size"], hf["num_experts"], hf["moe_intermediate_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    specs = [("token_embd.weight", (v, h), "F16", h**-0.5 * EMBED_SCALE)]
    for i in range(hf["num_hidden_layers"]):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (h,), "F32", None),
                  (b + "attn_q.weight", (q, h), "F16", h**-0.5),
                  (b + "attn_k.weight", (kv, h), "F16", h**-0.5),
                  (b + "attn_v.weight", (kv, h), "F16", h**-0.5),
                  (b + "attn_output.weight", (h, q), "F16", q**-0.5 * BLOCK_OUT_SCALE),
                  (b + "attn_q_norm.weight", (hf["head_dim"],), "F32", None),
                  (b + "attn_k_norm.weight", (hf["head_dim"],), "F32", None),
                  (b + "ffn_norm.weight", (h,), "F32", None),
                  (b + "ffn_gate_inp.weight", (e, h), "F32", h**-0.5),  # the router
                  (b + "ffn_gate_exps.weight", (e, f, h), "Q4_0", EXPERT_SCALE["ffn_gate_exps"]),
                  (b + "ffn_up_exps.weight", (e, f, h), "Q4_0", EXPERT_SCALE["ffn_up_exps"]),
                  (b + "ffn_down_exps.weight", (e, h, f), "Q4_0", EXPERT_SCALE["ffn_down_exps"])]
    return specs + [("output_norm.weight", (h,), "F32", None), ("output.weight", (v, h), "F16", h**-0.5)]


def _f16_bits(bits: np.ndarray, scale: float, signed: bool = True) -> np.ndarray:
    """Random uint16 -> fp16 bit patterns of magnitude in [scale, 4 scale): keep sign and mantissa, set the
    exponent to that of `scale` plus one random bit (~10x faster than drawing normals; in place)."""
    exponent = int(np.floor(np.log2(scale))) + 15
    bits &= np.uint16(0x87FF if signed else 0x07FF)
    bits += np.uint16(exponent << 10)
    return bits


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float | None) -> np.ndarray:
    """The tensor's bytes as GGUFWriter takes them: float arrays, or uint8 [..., row bytes] for Q4_0."""
    if scale is None:
        return np.ones(shape, np.float32)
    if kind in ("F16", "F32"):
        f16 = _f16_bits(rng.integers(0, 1 << 16, shape, np.uint16), scale / 2).view(np.float16)
        return f16 if kind == "F16" else f16.astype(np.float32)
    assert shape[-1] % Q4_0_BLOCK == 0, f"Q4_0 rows need a multiple of {Q4_0_BLOCK} values, got {shape}"
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // Q4_0_BLOCK * Q4_0_BYTES), np.uint8)
    _f16_bits(blocks.reshape(-1, Q4_0_BYTES).view(np.uint16)[:, 0], scale, signed=False)  # each block's d
    return blocks


def load_vocab(tokenizer_json: str | os.PathLike, vocab_size: int) -> dict:
    """tokens, token types, merges and special ids from a HF tokenizer.json (.gz), the way llama.cpp's
    convert_hf_to_gguf.py `_set_vocab_gpt2` writes them."""
    from gguf import TokenType

    opener = gzip.open if str(tokenizer_json).endswith(".gz") else open
    with opener(tokenizer_json, "rt", encoding="utf-8") as f:
        tok = json.load(f)
    ids = dict(tok["model"]["vocab"]) | {a["content"]: a["id"] for a in tok["added_tokens"]}
    if max(ids.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(ids.values())}, past vocab_size {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, TokenType.NORMAL
    for a in tok["added_tokens"]:  # special, or looking special (<|...|>): control; else user-defined
        control = a["special"] or (a["content"].startswith("<|") and a["content"].endswith("|>"))
        tokens[a["id"]], types[a["id"]] = a["content"], TokenType.CONTROL if control else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(p.replace(" ", chr(ord(" ") + 256)) for p in m)
              for m in tok["model"]["merges"]]
    special = {k: ids[v] for k, v in SPECIAL.items() if v in ids}
    return dict(tokens=tokens, types=types, merges=merges, special=special)


def write_gguf(path: str | os.PathLike, geometry: str = "qwen3-30b", layers: int | None = None, seed: int = 0,
               tokenizer_json: str | os.PathLike = TOKENIZER_JSON, progress: bool = True, **overrides) -> None:
    """`overrides` replace geometry fields (e.g. hidden_size=256, num_experts=8 for a test-sized file);
    Q4_0 needs hidden_size and moe_intermediate_size to be multiples of 32."""
    import gguf

    hf = dict(GEOMETRIES[geometry]) | overrides
    if hf["model_type"] != "qwen3_moe":
        raise ValueError(f"llama.cpp's qwen3moe writer takes the qwen3-30b geometry, not {geometry}")
    if layers:
        hf["num_hidden_layers"] = layers
    vocab = load_vocab(tokenizer_json, hf["vocab_size"])
    w = gguf.GGUFWriter(os.fspath(path), "qwen3moe")
    w.add_type("model")
    w.add_name(f"moestream synthetic {geometry}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_expert_count(hf["num_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])  # norm_topk_prob: qwen3moe's graph always does
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    for kind, token_id in vocab["special"].items():
        getattr(w, f"add_{kind}_token_id")(token_id)
    w.add_add_bos_token(False)

    specs = tensor_specs(hf)
    for name, shape, kind, _ in specs:
        if kind == "Q4_0":  # GGUFWriter takes quantized tensors as uint8 rows of bytes
            byte_shape = (*shape[:-1], shape[-1] // Q4_0_BLOCK * Q4_0_BYTES)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            dtype = np.dtype(np.float16 if kind == "F16" else np.float32)
            w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, start, written = np.random.default_rng(seed), time.time(), 0
    # the next tensor is drawn while this one is written (writes release the GIL)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(random_tensor, rng, *specs[0][1:])
        for i, (name, *_) in enumerate(specs):
            data = pending.result()
            if i + 1 < len(specs):
                pending = pool.submit(random_tensor, rng, *specs[i + 1][1:])
            w.write_tensor_data(data)
            written += data.nbytes
            if progress and (name.endswith("ffn_down_exps.weight") or i + 1 == len(specs)):
                print(f"{name.split('.ffn')[0]}: {written / 1e9:.2f} GB in {time.time() - start:.0f} s",
                      file=sys.stderr, flush=True)
    w.close()


def parse_bench(results: list[dict]) -> list[dict]:
    """llama-bench `-o json` entries -> rows. pp512: a 512-token prompt; tg128: 128 tokens generated one at a
    time; scenario "gpu" has all weights on the GPU, "n_cpu_moe=N" the experts of N layers in CPU RAM."""
    rows = []
    for r in results:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}" if r["n_prompt"] == 0 \
            else f"pp{r['n_prompt']}+tg{r['n_gen']}"
        if r.get("n_depth"):
            test += f"@d{r['n_depth']}"
        scenario = f"n_cpu_moe={r['n_cpu_moe']}" if r.get("n_cpu_moe") else "gpu"
        rows.append({"scenario": scenario, "test": test, "tok_s": r["avg_ts"], "stddev": r["stddev_ts"]})
    return rows


def bench(binary: str, gguf: str, n_cpu_moe: tuple[int, ...] = (0,), prompts: tuple[int, ...] = (512, 4096),
          gen: int = 128, reps: int = 5, extra: tuple[str, ...] = (), timeout: float | None = None) -> dict:
    """{"rows": parse_bench(...), "llama_bench": its JSON (build, GPU, model size, samples)}."""
    cmd = [binary, "-m", gguf, "-p", ",".join(map(str, prompts)), "-n", str(gen), "-ngl", "99", "-fa", "1",
           "-r", str(reps), "-ncmoe", ",".join(map(str, n_cpu_moe)), "-o", "json", *extra]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        tail = "\n".join(run.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-bench exited {run.returncode}:\n{tail}")
    results = json.loads(run.stdout)
    return {"rows": parse_bench(results), "llama_bench": results}


N_CPU_MOE = 36  # of 48 layers' experts in CPU RAM: the nearest to the suite's 25% pool with the host tier


def suite_rows(bench_rows: list[dict], variant: str = "") -> list[dict]:
    """`parse_bench` rows as the suite's (benchmarks/suite.py): llama-bench's tgN is decode (after an empty
    context; the suite's follows a 16-token prompt), ppN a prefill of N tokens; all on the GPU is a pool of 100%,
    experts of `N_CPU_MOE` layers in RAM the suite's 25% pool with the host tier. `variant`: the flags added to the
    engine's name (" --repack 0")."""
    rows = []
    for r in bench_rows:
        offloaded = r["scenario"] != "gpu"
        decode = r["test"].startswith("tg")
        rows.append({"model": "qwen3-30b", "engine": ENGINES[offloaded] + variant, "pool": 0.25 if offloaded else 1.0,
                     "host_tier": offloaded, "scenario": "decode" if decode else "prefill",
                     "tokens": 16 if decode else int(r["test"][2:]), "rate": r["tok_s"], "stddev": r["stddev"]})
    return rows


ENGINES = {False: "llama.cpp (GPU)", True: f"llama.cpp --n-cpu-moe {N_CPU_MOE}"}
# CPU weights in llama.cpp's repacked (or AMX) buffers are not host buffers, which its scheduler's op offload (a
# large batch's weights copied to the GPU) requires: `--repack 0` keeps them plain, so long prompts run on the GPU
NO_REPACK = ("--repack", "0")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gguf", help="write a random-weight GGUF")
    g.add_argument("out")
    g.add_argument("--geometry", default="qwen3-30b")
    g.add_argument("--layers", type=int)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=str(TOKENIZER_JSON), help="a HF tokenizer.json, or .json.gz")
    b = sub.add_parser("bench", help="run llama-bench on a GGUF")
    b.add_argument("binary")
    b.add_argument("gguf")
    b.add_argument("out")
    b.add_argument("--n-cpu-moe", type=_ints, default=(0,), help="comma list: one run each (0: all on the GPU)")
    b.add_argument("--prompts", type=_ints, default=(512, 4096))
    b.add_argument("--gen", type=int, default=128)
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--timeout", type=float)
    b.add_argument("--extra", default="", help="more llama-bench arguments, space-separated")
    a = p.parse_args()
    if a.cmd == "gguf":
        if not os.path.isfile(a.tokenizer):
            sys.exit(f"error: no tokenizer at {a.tokenizer}")
        write_gguf(a.out, a.geometry, a.layers, a.seed, a.tokenizer)
        print(f"wrote {a.out} ({os.path.getsize(a.out) / 1e9:.2f} GB)", file=sys.stderr)
        return
    for path in (a.binary, a.gguf):
        if not os.path.isfile(path):
            sys.exit(f"error: no such file {path}")
    try:
        out = bench(a.binary, a.gguf, a.n_cpu_moe, a.prompts, a.gen, a.reps, tuple(a.extra.split()), a.timeout)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        sys.exit(f"error: {e}")
    Path(a.out).write_text(json.dumps(out, indent=1))
    for r in out["rows"]:
        print(f"{r['scenario']:>14} {r['test']:>8} {r['tok_s']:10.1f} ± {r['stddev']:.1f} tok/s")


if __name__ == "__main__":
    main()
