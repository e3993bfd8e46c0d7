"""Make real MLX 4-bit checkpoints offline with mlx_lm, from tiny HF checkpoints."""

from __future__ import annotations

import json
import os
import shutil

from tests.packer.helpers import fuse_experts

MLX_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe")


def mlx_compatible_copy(hf_path: str, dst: str) -> str:
    """mlx_lm reads pre-5.x config field names; add them (the weights are untouched)."""
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(os.path.join(hf_path, "config.json")))
    if cfg["model_type"] == "qwen3_5_moe_text":  # real Qwen3.5 checkpoints fuse their experts
        fuse_experts(hf_path, dst, cfg["num_experts"])
    else:
        shutil.copytree(hf_path, dst)
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if cfg["model_type"] == "qwen3_5_moe_text":
        cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    json.dump(cfg, open(path, "w"), indent=1)
    return dst


def mlx_convert(hf_path: str, out: str, group_size: int = 64, bits: int = 4) -> str:
    from mlx_lm import convert

    src = mlx_compatible_copy(hf_path, out + "-hf")
    convert(src, mlx_path=out, quantize=True, q_group_size=group_size, q_bits=bits)
    return out
