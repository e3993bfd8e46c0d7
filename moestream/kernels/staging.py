"""Launching the host-tier staging of a batched addressed decode step (triton/staging.py): two launches, no host
synchronisation, so the step stays one CUDA graph. The bytes each entry reads are the same as in place, so the
expert kernels' results do not change; only where the bytes come from does."""

from __future__ import annotations

import torch
import triton

from moestream.experts.grouping import HostStaging

CHUNK = 64 << 10  # bytes a copy program moves: a 2.6 MB record in ~40 programs


def stage_host_records(table: torch.Tensor, ids: torch.Tensor, staging: HostStaging) -> torch.Tensor:
    """reference.stage_plan, then the copies: the table the step's entries read (valid at `ids` only)."""
    from moestream.kernels.triton.staging import stage_copy_kernel, stage_plan_kernel

    capacity, stride = staging.slots.shape
    slot_base = staging.slots.data_ptr()
    stage_plan_kernel[(1,)](table, ids, staging.table, staging.sources, ids.shape[0], staging.host_base,
                            staging.host_end, slot_base, SLOT_STRIDE=stride, CAPACITY=capacity,
                            NP=triton.next_power_of_2(ids.shape[0]), num_warps=4)
    stage_copy_kernel[(capacity, triton.cdiv(staging.record_bytes, CHUNK))](
        staging.sources, slot_base, SLOT_STRIDE=stride, NBYTES=staging.record_bytes, CHUNK=CHUNK, BLOCK=1024,
        num_warps=4)
    return staging.table
