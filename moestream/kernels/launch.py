"""Programmatic dependent launch (Hopper on): the expert down GEMV launches as a dependent of gate/up, so it
starts while gate/up still runs, loads its first weights, and waits (griddepcontrol.wait) before it reads h.
Launching every decode kernel this way measured slower beside the Triton dense GEMV (docs/performance.md)."""

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
