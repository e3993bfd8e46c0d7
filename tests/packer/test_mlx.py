"""A real MLX 4-bit checkpoint (made by mlx_lm) packs experts bit for bit and dense tensors correctly."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moestream.packer.pack import PackOptions, pack
from tests.packer.helpers import load_manifest, read_record
from tests.packer.mlx_helpers import MLX_TYPES, mlx_convert

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
           ".q_norm.weight", ".k_norm.weight")


def _mlx_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(mx.load(os.path.join(path, f)))
    return out


def _np(a):
    return torch.from_numpy(np.array(a.astype(mx.float32)))


@pytest.fixture(scope="module")
def mlx_stores(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx")
    out = {}
    for mt in MLX_TYPES:
        mlx = mlx_convert(tiny.checkpoint(mt), str(root / f"mlx_{mt}"))
        store = str(root / f"store_{mt}")
        pack(mlx, store, PackOptions(show_progress=False))
        out[mt] = (mlx, store)
    return out


@pytest.mark.parametrize("model_type", MLX_TYPES)
def test_mlx_experts_bit_for_bit(mlx_stores, model_type):
    mlx, store = mlx_stores[model_type]
    tensors = _mlx_tensors(mlx)
    manifest = load_manifest(store)
    checked = 0
    for name, arr in tensors.items():
        if ".switch_mlp." not in name or not name.endswith(".weight"):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        proj = name.split(".switch_mlp.")[1].split("_proj")[0]
        slot = manifest.geometry.layer_ids.index(layer)
        for e in range(arr.shape[0]):
            rec = read_record(store, "q4", manifest.geometry.rid(slot, e))
            for part, key in (("weight", "w"), ("scales", "s"), ("biases", "b")):
                t = tensors[name[: -len("weight")] + part][e]
                src = np.array(t.view(mx.uint16) if t.dtype == mx.bfloat16 else t)
                got = rec[f"{proj}_{key}"].contiguous().view(torch.uint8).numpy()
                assert src.tobytes() == got.tobytes(), (name, e, part)
            checked += 1
    assert checked == manifest.geometry.num_layers * manifest.geometry.num_experts * 3


@pytest.mark.parametrize("model_type", MLX_TYPES)
def test_mlx_dense_tensors_dequantized(mlx_stores, model_type):
    mlx, store = mlx_stores[model_type]
    tensors = _mlx_tensors(mlx)
    quant = load_manifest(store).config.get("quantization", {})
    hybrid = model_type in ("qwen3_next", "qwen3_5_moe")
    with safe_open(os.path.join(store, "dense.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for name, arr in tensors.items():
            if ".switch_mlp." in name or name.endswith((".scales", ".biases")):
                continue
            ours = name.replace("language_model.model.", "model.").replace("language_model.lm_head", "lm_head")
            assert ours in keys, ours
            module = name[: -len(".weight")]
            if module + ".scales" in tensors:
                override = quant.get(module, {}) if isinstance(quant.get(module), dict) else {}
                # MLX's own dequantization in fp32 (a bf16 one rounds twice), then bf16 as stored
                scales, biases = (tensors[module + p].astype(mx.float32) for p in (".scales", ".biases"))
                want = _np(mx.dequantize(arr, scales, biases,
                                         group_size=override.get("group_size", 64), bits=override.get("bits", 4)))
            else:
                want = _np(arr)
                if hybrid and ours.endswith(SHIFTED) and want.ndim == 1:
                    want = want - 1.0  # mlx_lm stores these zero-centred norms as 1 + w
                if "conv1d.weight" in ours:
                    want = want.transpose(1, 2)
            got = f.get_tensor(ours).float()
            assert got.shape == want.shape, ours
            torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0, msg=ours)


def test_mlx_routers_use_their_8bit_override(mlx_stores):
    mlx, _ = mlx_stores["qwen3_next"]
    quant = load_manifest(mlx_stores["qwen3_next"][1]).config["quantization"]
    assert quant["model.layers.0.mlp.gate"]["bits"] == 8  # the per-module override the dense check covered


def test_group_size_32_is_refused(tiny, tmp_path):
    mlx = mlx_convert(tiny.checkpoint("qwen3_moe"), str(tmp_path / "mlx32"), group_size=32)
    proc = subprocess.run([sys.executable, "-m", "moestream", "pack", mlx, "-o", str(tmp_path / "s")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "group size 32" in proc.stderr


@pytest.mark.parametrize("model_type", MLX_TYPES)
def test_mlx_store_logits(mlx_stores, tiny, tmp_path, model_type):
    """Against transformers given the same (MLX-dequantized) weights: exact to fp32 rounding. Against
    mlx_lm's own forward (in fp32): close; its qwen3_5 implementation differs from transformers' (ours
    follows transformers), so there only the transformers check applies."""
    from safetensors.torch import load_file, save_file

    from moestream.engine.llm import LLM
    from tests.models.oracle import assert_logits_close, dequantize_experts, hf_logits

    mlx, store = mlx_stores[model_type]
    hf = dequantize_experts(tiny.checkpoint(model_type), store, str(tmp_path / "hf"))
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    tensors.update({k: v.float() for k, v in load_file(os.path.join(store, "dense.safetensors")).items()})
    save_file(tensors, os.path.join(hf, "model.safetensors"))
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 320, 30)]
    llm = LLM(store, device="cpu", dtype="float32")
    ours = llm.logits(ids)
    llm.close()
    assert_logits_close(ours, hf_logits(hf, torch.tensor(ids)))
    if model_type == "qwen3_5_moe":
        return
    from mlx_lm import load

    model, _ = load(mlx)
    model.set_dtype(mx.float32)
    ref = torch.from_numpy(np.array(model(mx.array([ids])).astype(mx.float32))[0])
    assert (ours - ref).abs().max() <= 0.03 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_per_tensor_group_size_override(mlx_stores, tmp_path):
    """A dense tensor requantized with its own bits and group size (named in config.json) dequantizes
    with them."""
    import json
    import shutil

    src = tmp_path / "mlx"
    shutil.copytree(mlx_stores["qwen3_moe"][0], src)
    tensors = _mlx_tensors(str(src))
    head = mx.dequantize(tensors["lm_head.weight"], tensors["lm_head.scales"], tensors["lm_head.biases"],
                         group_size=64, bits=4)
    w, s, b = mx.quantize(head, group_size=32, bits=8)
    tensors.update({"lm_head.weight": w, "lm_head.scales": s, "lm_head.biases": b})
    for f in src.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    (src / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in cfg:
            cfg[key]["lm_head"] = {"group_size": 32, "bits": 8}
    (src / "config.json").write_text(json.dumps(cfg))
    pack(str(src), str(tmp_path / "store"), PackOptions(show_progress=False))
    want = _np(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=8))
    with safe_open(str(tmp_path / "store" / "dense.safetensors"), framework="pt") as f:
        got = f.get_tensor("lm_head.weight").float()
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0)
