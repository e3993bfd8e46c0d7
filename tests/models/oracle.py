"""transformers as the oracle: reference logits and greedy tokens for a checkpoint."""

from __future__ import annotations

import functools
import inspect
import sys

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch_paths(sys.modules[type(model).__module__])
    return model


def torch_paths(module) -> None:
    """transformers before 5.25 sends CPU tensors to fla's Triton kernels once fla imports (moestream's prefill
    does): the oracle, on the CPU, calls the torch functions (`torch_*`) that those kernels stand in for."""
    for name, fn in list(vars(module).items()):
        if name.startswith("torch_") and callable(fn) and hasattr(fn, "__wrapped__"):
            setattr(module, name, inspect.unwrap(fn))


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
    """Copy checkpoint `src` (or a store's dense file) to `out` with every expert weight set from its Q4 record in
    `store`, dequantized (fp32), named per expert as transformers loads them (`mtp.layers.*` for record layer -1)."""
    import os
    import shutil

    from safetensors.torch import save_file

    from moestream.quant.affine import dequantize
    from tests.packer.helpers import load_manifest, read_record, source_tensors

    tensors = source_tensors(src)
    geometry = load_manifest(store).geometry
    for index, layer in enumerate(geometry.layer_ids):
        prefix = f"model.layers.{layer}" if layer >= 0 else f"mtp.layers.{-1 - layer}"
        for e in range(geometry.num_experts):
            rec = read_record(store, "q4", geometry.rid(index, e))
            for p in ("gate", "up", "down"):
                w = dequantize(rec[f"{p}_w"], rec[f"{p}_s"], rec[f"{p}_b"]).to(torch.float32)
                tensors[f"{prefix}.mlp.experts.{e}.{p}_proj.weight"] = w
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "*.bin"))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out
