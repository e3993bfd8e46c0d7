"""Launching decode in one launch a layer (triton/expert_fused.py): every tile its own program (`fused` 1), or as
many programs as fit on the GPU at once, each loading its next tile while it computes one (`fused` 2)."""

from __future__ import annotations

import ctypes
import functools

import torch

COUNTED_ENTRIES = 4096  # the most routing entries a one-launch decode takes (past that: two launches)


@functools.cache  # one buffer a device for good: captured graphs hold its address
def arrival_counts(device: torch.device) -> torch.Tensor:
    """Two int32 counters an entry, zeroed; every launch leaves them zeroed."""
    return torch.zeros(2 * COUNTED_ENTRIES, dtype=torch.int32, device=device)


@functools.cache
def whole_rows(k: int) -> tuple[int, int, int] | None:
    """K as up to three power-of-two parts of at least a group (768 = 512 + 256), or None."""
    parts, rest = [], k
    while rest and len(parts) < 3:
        parts.append(1 << (rest.bit_length() - 1))
        rest -= parts[-1]
    return None if rest or parts[-1] < 64 else (*parts, 0, 0)[:3]


_programs: dict = {}  # resident programs by kernel, once it has compiled


def resident_programs(key, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on the GPU at once; one an SM until it has compiled."""
    return _programs.get(key) or torch.cuda.get_device_properties(device).multi_processor_count


def learn_residency(key, kernel, device: torch.device) -> None:
    """Record what `resident_programs` answers for `kernel` (a compiled Triton kernel) from the driver's
    occupancy calculator: a persistent launch of more programs than fit could wait forever."""
    if key in _programs or not hasattr(kernel, "function"):
        return
    blocks = ctypes.c_int(0)
    rc = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(kernel.function), 32 * kernel.metadata.num_warps,
        ctypes.c_size_t(kernel.metadata.shared))
    if rc == 0 and blocks.value > 0:
        _programs[key] = blocks.value * torch.cuda.get_device_properties(device).multi_processor_count


def launch_persistent(x, h, out, entries, addr, records, n: int, offsets: dict, field_mask: int, layout,
                      top_k: int, cfg, indirect: bool, pdl: bool, options: dict) -> bool:
    """`fused` 2 (expert_mlp.launch_decode's arguments); False where the geometry is not covered (K in more than
    three parts), and nothing launched."""
    from moestream.kernels.triton.expert_fused import persistent_decode_kernel

    hidden, inter = layout.hidden_size, layout.intermediate_size
    up, down = whole_rows(hidden), whole_rows(inter)
    if up is None or down is None:
        return False
    key = (layout, cfg, indirect, pdl)
    programs = resident_programs(key, x.device) if x.is_cuda else 1  # the interpreter runs programs one by one
    kernel = persistent_decode_kernel[(programs,)](
        x, h, out, entries, addr, records, arrival_counts(x.device), n, *offsets.values(), field_mask, H=hidden,
        I=inter, TOP_K=top_k, BITS=layout.bits, GROUP=layout.group_size or 64, BN_UP=cfg.bn_gate_up, U1=up[0],
        U2=up[1], U3=up[2], BN_DOWN=cfg.bn_down, D1=down[0], D2=down[1], D3=down[2], PDL=pdl, INDIRECT=indirect,
        num_warps=cfg.num_warps, num_stages=1, **options)
    if x.is_cuda:
        learn_residency(key, kernel, x.device)
    return True
