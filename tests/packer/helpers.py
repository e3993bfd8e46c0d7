"""Test helpers: read a store's records and rewrite checkpoints into other layouts."""

from __future__ import annotations

import glob
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.experts.format import MANIFEST, Manifest, experts_file


def source_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def load_manifest(store: str) -> Manifest:
    with open(os.path.join(store, MANIFEST)) as f:
        return Manifest.from_json(json.load(f))


def read_record(store: str, precision: str, rid: int) -> dict[str, torch.Tensor]:
    layout = load_manifest(store).layouts[precision]
    with open(os.path.join(store, experts_file(precision)), "rb") as f:
        f.seek(rid * layout.stride)
        raw = bytearray(f.read(layout.stride))
    return {k: v.clone() for k, v in layout.views(torch.frombuffer(raw, dtype=torch.uint8)).items()}


def fuse_experts(src: str, dst: str, num_experts: int) -> None:
    """Rewrite a per-expert checkpoint with fused `experts.gate_up_proj` / `experts.down_proj`."""
    os.makedirs(dst, exist_ok=True)
    tensors = source_tensors(src)
    out, layers = {}, set()
    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    for k, v in tensors.items():
        if m := pat.match(k):
            layers.add(m[1])
        else:
            out[k] = v
    for prefix in layers:
        gate = [tensors[f"{prefix}.{e}.gate_proj.weight"] for e in range(num_experts)]
        up = [tensors[f"{prefix}.{e}.up_proj.weight"] for e in range(num_experts)]
        down = [tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(num_experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(out, os.path.join(dst, "model.safetensors"))
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
                b.write(a.read())
