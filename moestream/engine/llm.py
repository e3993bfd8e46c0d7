"""The public engine API: `LLM(store, ...)` with `logits`, `generate` and `stats`."""

from __future__ import annotations

import torch

from moestream.engine.loader import load_model
from moestream.experts.resident import ResidentProvider
from moestream.experts.store import open_store


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    def __init__(self, store: str, device: str | None = None, dtype: str | None = None, pool_gb: float | None = None,
                 host_gb: float = 0.0, experts: int = 4):
        self.device = torch.device(device or default_device())
        self.dtype = getattr(torch, dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        self.store = open_store(store)
        self.config = self.store.model
        self.model = load_model(self.store, self.device, self.dtype)
        precision = {4: "q4", 3: "q3", 2: "q2", 16: "bf16"}[experts]
        self.provider = ResidentProvider(self.store, precision, self.device)
        for block in self.model.moe_blocks():
            block.provider = self.provider

    @torch.inference_mode()
    def logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """One prompt's full-sequence logits [T, vocab] (float32)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        state = self.model.new_state(self.dtype, self.device)
        return self.model.logits(self.model(ids, state))
