"""Programmatic dependent launch (Hopper on): the expert down GEMV launches as a dependent of gate/up, so it
starts while gate/up still runs, loads its first weights, and waits (griddepcontrol.wait) before it reads h.
Launching every decode kernel this way measured slower beside the Triton dense GEMV (docs/performance.md). And the
arrival counts of kernels whose last program to finish a piece of work completes it (one launch, not two)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent(x: torch.Tensor) -> bool:
    """Whether a kernel reading `x` can launch as a dependent of the kernel before it."""
    return x.is_cuda and _hopper(x.device)


def options(pdl: bool) -> dict:
    """The launch keyword a dependent launch needs."""
    return {"launch_pdl": True} if pdl else {}


_COUNTS: dict[tuple, torch.Tensor] = {}


def arrival_counts(key, size: int, device: torch.device) -> torch.Tensor:
    """int32 counts [size] that a kernel's programs count themselves in, zero between launches (the last to arrive
    resets its own): one set a key, made at its first eager launch. Made inside a capture, they stay that graph's
    (its zeros exist only once it replays). Launches sharing a key must never run at once."""
    if (key, device) in _COUNTS:
        return _COUNTS[key, device]
    counts = torch.zeros(size, dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _COUNTS[key, device] = counts
    return counts
