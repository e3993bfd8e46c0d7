"""One module per HF model_type, each exporting `Model` (a CausalLM)."""

from __future__ import annotations

import importlib

from moestream.config import ModelConfig


def model_class(cfg: ModelConfig):
    return importlib.import_module(f"moestream.models.{cfg.model_type}").Model
