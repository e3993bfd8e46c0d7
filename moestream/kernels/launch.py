"""Programmatic dependent launch (Hopper on): a kernel launched as a dependent may start while the kernel before
it in the stream still runs, and waits (griddepcontrol.wait) before it touches that kernel's outputs, so the
launch latency between a decode step's small kernels overlaps the kernel before.

`MOESTREAM_PDL`: "down" (the default: the expert down GEMV alone, measured on the H200), "all" (every Triton
kernel of the decode path: 14% faster graphed decode alone on the H200, but slower beside the Triton dense
GEMV), or "off"."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent(x: torch.Tensor, scope: str = "all") -> bool:
    """Whether a kernel reading `x` launches as a dependent: `scope` "down" for the expert down GEMV, "all" for
    the others."""
    mode = os.environ.get("MOESTREAM_PDL", "down")
    return x.is_cuda and mode != "off" and (mode == "all" or scope == "down") and _hopper(x.device)


def options(pdl: bool) -> dict:
    """The launch keyword a dependent launch needs."""
    return {"launch_pdl": True} if pdl else {}
