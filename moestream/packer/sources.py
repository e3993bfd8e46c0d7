"""Checkpoint folders as tensor sources: Hugging Face safetensors (bf16/fp16/fp32) and MLX affine.

A source normalises tensor names to the HF text-model layout (`model.layers.N...`, `lm_head`,
`mtp.*`), drops vision towers, and hands out dense tensors in HF conventions: MLX-quantized tensors
are dequantized and mlx_lm's sanitize steps (norm +1, conv axis order) are undone.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moestream.config import ModelConfig, normalise_model_type, text_config
from moestream.errors import SourceError
from moestream.experts.format import MANIFEST
from moestream.packer.safetensors_io import TensorInfo, read_header, read_rows

_SKIP = re.compile(r"^(model\.visual|visual|vision_tower|model\.vision_tower|model\.audio|audio_tower)\.")
_PREFIXES = [("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("language_model.", "")]
# mlx_lm adds 1 to these (zero-centred) norms of hybrid models, and stores conv1d as [C, K, 1].
_MLX_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                      ".q_norm.weight", ".k_norm.weight")


def normalise_name(raw: str) -> str | None:
    if _SKIP.match(raw):
        return None
    for old, new in _PREFIXES:
        if raw.startswith(old):
            return new + raw[len(old):]
    return raw


def unpack_bitstream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """MLX packed codes (any width: a little-endian bit stream per row) -> int64 codes [rows, n]."""
    raw = words.contiguous().view(torch.uint8).numpy().reshape(words.shape[0], -1)
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    n = stream.shape[1] // bits
    weights = (1 << np.arange(bits, dtype=np.int64))
    codes = stream[:, : n * bits].reshape(words.shape[0], n, bits).astype(np.int64) @ weights
    return torch.from_numpy(codes)


def mlx_dequantize(w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    lead = w.shape[:-1]
    codes = unpack_bitstream(w.reshape(-1, w.shape[-1]), bits).float()
    g = codes.reshape(codes.shape[0], -1, group)
    out = g * scales.reshape(-1, scales.shape[-1], 1).float() + biases.reshape(-1, biases.shape[-1], 1).float()
    return out.reshape(*lead, -1)


@dataclass
class CheckpointSource:
    path: str
    kind: str  # "hf" or "mlx"
    config: dict[str, Any]
    model: ModelConfig
    tensors: dict[str, TensorInfo]  # normalised name -> where its bytes are
    quantization: dict[str, Any] = field(default_factory=dict)

    def quant_params(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of an MLX-quantized module (`config.json` may override per module)."""
        q = self.quantization
        raw = q.get(module, {})
        if raw is False:
            raise SourceError(f"{module} is marked unquantized but has scales")
        return int(raw.get("bits", q["bits"])), int(raw.get("group_size", q["group_size"]))

    def is_quantized(self, name: str) -> bool:
        return name.endswith(".weight") and name[: -len(".weight")] + ".scales" in self.tensors

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return read_rows(self.tensors[name], start, stop)

    def dense(self, name: str) -> torch.Tensor:
        """A dense tensor in HF conventions (MLX ones dequantized and un-sanitized)."""
        t = self.read(name)
        if self.kind != "mlx":
            return t
        if self.is_quantized(name):
            module = name[: -len(".weight")]
            bits, group = self.quant_params(module)
            t = mlx_dequantize(t, self.read(module + ".scales"), self.read(module + ".biases"), bits, group)
            t = t.to(torch.bfloat16)
        if self.model.is_hybrid and t.ndim == 1 and name.endswith(_MLX_SHIFTED_NORMS) \
                and not name.startswith("mtp."):
            t = (t.float() - 1.0).to(t.dtype)
        if "conv1d.weight" in name and t.ndim == 3 and t.shape[-1] == 1:
            t = t.transpose(1, 2).contiguous()
        return t

    def dense_shape(self, name: str) -> tuple[int, ...]:
        info = self.tensors[name]
        shape = info.shape
        if self.kind == "mlx" and self.is_quantized(name):
            bits, _ = self.quant_params(name[: -len(".weight")])
            shape = (*shape[:-1], shape[-1] * 32 // bits)
        if self.kind == "mlx" and "conv1d.weight" in name and len(shape) == 3 and shape[-1] == 1:
            shape = (shape[0], 1, shape[1])
        return shape


def open_source(path: str) -> CheckpointSource:
    if not os.path.isdir(path):
        raise SourceError(f"no such checkpoint folder: {path}")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        raise SourceError(f"{path} is a moestream store, packed already: `generate` and `serve` take it as is")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise SourceError(f"{path} has no config.json; is it a Hugging Face or MLX checkpoint folder?")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{cfg_path}: unreadable ({e})") from None
    normalise_model_type(text_config(config).get("model_type"))
    hf_quant = config.get("quantization_config") or {}
    mlx_quant = config.get("quantization") or (hf_quant if "group_size" in hf_quant else None)
    if hf_quant and not mlx_quant:
        method = hf_quant.get("quant_method", "unknown")
        raise SourceError(f"{path}: {method}-quantized Hugging Face checkpoints are not supported; "
                          "use the bf16/fp16 original or an MLX 4-bit conversion")
    model = ModelConfig.from_hf(config)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            wanted = sorted(set(json.load(f)["weight_map"].values()))
        if missing := [w for w in wanted if w not in files]:
            raise SourceError(f"{path}: shard {missing[0]} named in model.safetensors.index.json is missing")
        files = wanted
    if not files:
        raise SourceError(f"{path} holds no .safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        for raw, info in read_header(os.path.join(path, fname)).items():
            if (name := normalise_name(raw)) is not None:
                tensors[name] = info
    mlx = mlx_quant is not None or any(".switch_mlp." in n for n in tensors)
    if mlx and mlx_quant and mlx_quant.get("mode", "affine") != "affine":
        raise SourceError(f"{path}: MLX quantization mode {mlx_quant['mode']!r} is not supported (affine only)")
    quant = {}
    for k, v in (mlx_quant or {}).items():
        module = normalise_name(k + ".x") if isinstance(v, (dict, bool)) else None
        quant[module[:-2] if module else k] = v
    return CheckpointSource(path, "mlx" if mlx else "hf", config, model, tensors, quant)
