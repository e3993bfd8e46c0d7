import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from moestream.experts.format import DENSE_FILE, PROGRESS_FILE
from moestream.packer.pack import PackOptions, pack
from moestream.quant.affine import dequantize
from tests.conftest import MODEL_TYPES
from tests.packer.helpers import fuse_experts, load_manifest, read_record, source_tensors

EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _check_experts(ckpt: str, store: str) -> int:
    manifest = load_manifest(store)
    slot_of = {layer: s for s, layer in enumerate(manifest.geometry.layer_ids)}
    n = 0
    for name, w in source_tensors(ckpt).items():
        if not (m := EXPERT.match(name)):
            continue
        rid = manifest.geometry.rid(slot_of[int(m[1])], int(m[2]))
        exact = read_record(store, "bf16", rid)[f"{m[3]}_w"]
        assert torch.equal(exact.view(torch.int16), w.view(torch.int16)), name  # the same bits
        q = read_record(store, "q4", rid)
        p = m[3]
        d = dequantize(q[f"{p}_w"], q[f"{p}_s"], q[f"{p}_b"])
        step = q[f"{p}_s"].float().repeat_interleave(64, dim=1)
        assert ((d - w.float()).abs() <= step / 2 + step * 1e-5).all(), name
        n += 1
    return n


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pack_each_model_type(tiny, model_type):
    ckpt, store = tiny.checkpoint(model_type), tiny.store(model_type)
    manifest = load_manifest(store)
    cfg = manifest.geometry
    assert _check_experts(ckpt, store) == cfg.num_layers * cfg.num_experts * 3
    src = {k: v for k, v in source_tensors(ckpt).items() if not EXPERT.match(k) and "ngram_embedding" not in k}
    with safe_open(os.path.join(store, DENSE_FILE), framework="pt") as f:
        assert set(f.keys()) == set(src)
        for k, v in src.items():
            assert torch.equal(f.get_tensor(k), v), k
    assert os.path.isfile(os.path.join(store, "config.json"))
    assert not os.path.exists(os.path.join(store, PROGRESS_FILE))


def test_qwen4_ngram_table_is_row_addressable(tiny):
    ckpt, store = tiny.checkpoint("qwen4_exp"), tiny.store("qwen4_exp")
    src = source_tensors(ckpt)
    shards = sorted((k for k in src if "ngram_embedding.shard_" in k), key=lambda k: int(k.split("shard_")[1][0]))
    table = torch.cat([src[k] for k in shards])
    (layout,) = load_manifest(store).ngram
    assert (layout.rows, layout.dim, layout.precision) == (table.shape[0], table.shape[1], "bf16")
    with open(os.path.join(store, f"ngram.{layout.layer}.bin"), "rb") as f:
        f.seek(7 * layout.row_bytes)
        row = torch.frombuffer(bytearray(f.read(layout.row_bytes)), dtype=torch.bfloat16)
    assert torch.equal(row, table[7])


def test_fused_experts_pack_like_per_expert(tiny, tmp_path):
    ckpt = tiny.checkpoint("qwen3_moe")
    fused = str(tmp_path / "fused")
    fuse_experts(ckpt, fused, num_experts=8)
    pack(fused, str(tmp_path / "store"), PackOptions(precisions=("q4", "bf16"), show_progress=False))
    ref = tiny.store("qwen3_moe")
    for precision in ("q4", "bf16"):
        with open(os.path.join(ref, f"experts.{precision}.bin"), "rb") as a, \
                open(tmp_path / "store" / f"experts.{precision}.bin", "rb") as b:
            assert a.read() == b.read()


def test_mtp_tensors_are_kept(tiny, tmp_path):
    from safetensors.torch import save_file

    ckpt = tiny.checkpoint("qwen3_next")
    dst = tmp_path / "mtp"
    dst.mkdir()
    tensors = source_tensors(ckpt)
    for k in [k for k in tensors if k.startswith("model.layers.3.")]:
        tensors["mtp.layers.0." + k[len("model.layers.3."):]] = tensors[k].clone()
    tensors["mtp.fc.weight"] = torch.randn(64, 128).bfloat16()
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    cfg["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(dst / "config.json", "w"))
    manifest = pack(str(dst), str(tmp_path / "store"), PackOptions(precisions=("bf16",), show_progress=False))
    assert manifest.geometry.num_layers == 5 and manifest.geometry.layer_ids[-1] == -1
    last = read_record(str(tmp_path / "store"), "bf16", manifest.geometry.rid(4, 2))
    assert torch.equal(last["up_w"], tensors["mtp.layers.0.mlp.experts.2.up_proj.weight"])
    with safe_open(str(tmp_path / "store" / DENSE_FILE), framework="pt") as f:
        assert "mtp.fc.weight" in f.keys() and "mtp.layers.0.self_attn.q_proj.weight" in f.keys()


def test_resume_after_interrupt(tiny, tmp_path, monkeypatch):
    import moestream.packer.pack as pack_module

    ckpt, out = tiny.checkpoint("qwen2_moe"), str(tmp_path / "store")
    real, calls = pack_module.encode_all, {"n": 0}

    def dying(*args):
        calls["n"] += 1
        if calls["n"] > 12:  # 8 experts per layer: dies inside the second layer
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(pack_module, "encode_all", dying)
    with pytest.raises(KeyboardInterrupt):
        pack(ckpt, out, PackOptions(precisions=("q4",), show_progress=False))
    progress = json.load(open(os.path.join(out, PROGRESS_FILE)))
    assert progress["layers_done"] == [0]
    monkeypatch.setattr(pack_module, "encode_all", real)
    pack(ckpt, out, PackOptions(precisions=("q4",), show_progress=False))
    with open(os.path.join(out, "experts.q4.bin"), "rb") as a, \
            open(os.path.join(tiny.store("qwen2_moe"), "experts.q4.bin"), "rb") as b:
        assert a.read() == b.read()
    # Packing again into a finished store of the same source and options is a no-op.
    assert pack(ckpt, out, PackOptions(precisions=("q4",), show_progress=False)).model_type == "qwen2_moe"
