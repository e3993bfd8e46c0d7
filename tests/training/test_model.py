"""The demo model's checkpoint: transformers loads it unchanged, and `pack` keeps its MTP module."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moestream.experts.format import DENSE_FILE
from moestream.packer.pack import PackOptions, pack
from training.model import (
    TINY,
    build,
    joint_forward,
    load_mtp_tensors,
    model_config,
    save_with_mtp,
    store_bytes,
    use_bf16_experts,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = model_config(320, **TINY)
    trunk, mtp = build(config, seed=0, dtype=torch.bfloat16)
    trunk, mtp = trunk.eval(), mtp.eval()
    path = str(tmp_path_factory.mktemp("demo") / "model")
    save_with_mtp(trunk, mtp, path)
    return config, trunk, mtp, path


def test_shipped_geometry_packs_to_about_20_mb():
    cfg = model_config()
    assert all(v % 64 == 0 for v in (cfg.hidden_size, cfg.moe_intermediate_size, cfg.vocab_size))
    assert 17e6 < store_bytes(cfg)["total"] < 21e6


def test_saved_folder_holds_the_qwen3_next_mtp_layout(saved):
    _, _, _, path = saved
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("mtp.")}
    for n in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight",
              "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.input_layernorm.weight"):
        assert n in mtp, n
    # the MTP decoder layer is named exactly like a trunk layer
    assert {n[len("mtp.layers.0."):] for n in mtp if n.startswith("mtp.layers.0.")} == \
           {n[len("model.layers.0."):] for n in names if n.startswith("model.layers.0.")}


def test_transformers_loads_it_with_the_same_logits(saved):
    from transformers import AutoModelForCausalLM

    _, trunk, mtp, path = saved
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids[:, :-1]).logits, trunk(ids[:, :-1]).logits)
        # and the MTP tensors round-trip into a fresh module
        _, fresh = build(loaded.config, dtype=torch.bfloat16)
        load_mtp_tensors(fresh, load_file(os.path.join(path, "model.safetensors")))
        a, b = joint_forward(trunk, mtp, ids)[1], joint_forward(loaded, fresh.eval(), ids)[1]
    assert torch.equal(a, b)


def test_pack_keeps_mtp_as_an_extra_record_layer(saved, tmp_path):
    config, _, _, path = saved
    manifest = pack(path, str(tmp_path / "store"), PackOptions(precisions=("q4",), show_progress=False))
    geometry = manifest.geometry
    assert geometry.layer_ids == (0, 1, -1) and geometry.num_experts == 8
    with safe_open(str(tmp_path / "store" / DENSE_FILE), framework="pt") as f:
        dense = set(f.keys())
    for n in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.self_attn.o_proj.weight"):
        assert n in dense, n
    assert not any(".experts." in n for n in dense)
    assert manifest.config.get("mtp_num_hidden_layers") == 1


def test_bf16_experts_path_matches_transformers():
    """The CUDA training path (bf16 grouped GEMMs under fp32 master weights) computes what transformers does."""
    trunk, mtp = build(model_config(320, **TINY), seed=0, dtype=torch.bfloat16)
    ids = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = joint_forward(trunk, mtp, ids)
        use_bf16_experts(trunk)
        got = joint_forward(trunk, mtp, ids)
    for a, b in zip(ref[:2], got[:2]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
