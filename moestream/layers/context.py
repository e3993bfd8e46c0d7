"""The step context: what one forward computes, made by the engine and read by the layers (the engine never
reaches into a layer). A forward over a captured CUDA graph replays with the same context object, so what
changes between steps lives in device tensors (`positions`, the expert addresses), never in Python values."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.experts.provider import ExpertStep


@dataclass
class StepContext:
    positions: torch.Tensor  # [T] int64, on the model's device
    # fixed buffers: attention over the whole reserved cache masked by `positions`, states updated in place, so
    # the step can be captured (one row)
    static: bool = False
    experts: ExpertStep = field(default_factory=ExpertStep)

    @classmethod
    def eager(cls, start: int, rows: int, device: torch.device, experts: ExpertStep | None = None) -> StepContext:
        """`rows` tokens after the first `start` of the sequence."""
        return cls(torch.arange(start, start + rows, device=device), experts=experts or ExpertStep())
