"""transformers as the oracle: reference logits and greedy tokens for a checkpoint."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    return hf_model(path)(ids[None]).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> float:
    """Max abs error within `rel` of the largest reference logit; returns the relative error."""
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} x {scale:.3g}"
    return err / scale


def dequantize_experts(src: str, store: str, out: str) -> str:
    """Copy checkpoint `src` to `out` with each expert weight replaced by its Q4 record, dequantized (fp32)."""
    import os
    import re
    import shutil

    from safetensors.torch import save_file

    from moestream.quant.affine import dequantize
    from tests.packer.helpers import load_manifest, read_record, source_tensors

    tensors = source_tensors(src)
    geometry = load_manifest(store).geometry
    pat = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
    for name in list(tensors):
        if m := pat.match(name):
            layer = int(m[2]) if m[1] == "model" else -1 - int(m[2])
            rec = read_record(store, "q4", geometry.rid(geometry.layer_ids.index(layer), int(m[3])))
            p = m[4]
            tensors[name] = dequantize(rec[f"{p}_w"], rec[f"{p}_s"], rec[f"{p}_b"]).to(torch.float32)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out
