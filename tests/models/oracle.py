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


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs error within `rel` of the largest reference logit."""
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} x {scale:.3g}"
