"""Shared fixtures: tiny random checkpoints and their stores, built once per session."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moestream.packer.pack import PackOptions, pack
from moestream.tiny import make_tiny_checkpoint

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # `interpretable` GPU tests also run on CPU under the Triton interpreter
        if "gpu" in item.keywords and not (interpret and "interpretable" in item.keywords):
            item.add_marker(skip)


class Factory:
    """Builds checkpoints and stores on demand, keyed by their arguments, under one session folder."""

    def __init__(self, root):
        self.root = root
        self.cache: dict[str, str] = {}

    def _key(self, *parts, **kw) -> str:
        return "-".join(map(str, parts)) + ("-" + json.dumps(kw, sort_keys=True) if kw else "")

    def checkpoint(self, model_type: str, seed: int = 0, **overrides) -> str:
        key = self._key("ckpt", model_type, seed, **overrides)
        if key not in self.cache:
            path = os.path.join(self.root, f"ckpt{len(self.cache)}")
            self.cache[key] = make_tiny_checkpoint(path, model_type, seed=seed, **overrides)
        return self.cache[key]

    def store(self, model_type: str, experts: tuple[str, ...] = ("q4", "bf16"), seed: int = 0, **overrides) -> str:
        key = self._key("store", model_type, experts, seed, **overrides)
        if key not in self.cache:
            src = self.checkpoint(model_type, seed, **overrides)
            out = os.path.join(self.root, f"store{len(self.cache)}")
            pack(src, out, PackOptions(precisions=experts, show_progress=False))
            self.cache[key] = out
        return self.cache[key]


    def dequantized(self, model_type: str, seed: int = 0, **overrides) -> str:
        """The checkpoint with every expert weight replaced by its Q4 dequantization (the Q4 oracle)."""
        key = self._key("deq", model_type, seed, **overrides)
        if key not in self.cache:
            from tests.models.oracle import dequantize_experts

            out = os.path.join(self.root, f"deq{len(self.cache)}")
            dequantize_experts(self.checkpoint(model_type, seed, **overrides),
                               self.store(model_type, seed=seed, **overrides), out)
            self.cache[key] = out
        return self.cache[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Factory:
    return Factory(str(tmp_path_factory.mktemp("tiny")))
