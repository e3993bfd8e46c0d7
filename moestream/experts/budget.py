"""Sizing the GPU pool: from `--pool-gb`, or from free memory; a pool below one step's need is refused."""

from __future__ import annotations

import os

import torch

from moestream.config import ExpertConfig
from moestream.errors import BudgetError
from moestream.experts.store import Store


def pool_slots_for(store: Store, cfg: ExpertConfig, device: torch.device, top_k: int, stride: int,
                   reserved: int = 0) -> int:
    """Pool size in records of `stride` bytes. One decode step needs `top_k` slots at once. From free memory, the
    pool leaves `reserved` bytes (parts made later: the batch slots' decode states) and some headroom."""
    total = store.manifest.geometry.num_records
    if cfg.pool_gb is not None:
        slots = int(cfg.pool_gb * 1e9 // stride)
        if slots < top_k:
            raise BudgetError(f"--pool-gb {cfg.pool_gb:g} holds {slots} expert records of {stride / 1e6:.2f} MB; "
                              f"one decode step needs at least {top_k} ({top_k * stride / 1e9:.3f} GB)")
        return min(slots, total)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        spare = free - max(2e9, 0.1 * free) - cfg.ring_slots * stride - reserved  # KV, activations, scratch
    else:
        spare = 0.4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    slots = min(total, int(spare // stride))
    if slots < top_k:
        raise BudgetError(f"only {max(spare, 0) / 1e9:.2f} GB is free for the expert pool; one decode step needs "
                          f"{top_k * stride / 1e9:.3f} GB ({top_k} records)")
    return slots
