"""Launching the tensor-core Q4 decode GEMVs (triton/expert_mma.py, Gluon): gate/up, then down as its dependent.
`launch_decode` takes this path for Q4 records with groups of 64 when its tile config says `mma`."""

from __future__ import annotations

import functools

import torch

from moestream.experts.format import RecordLayout
from moestream.kernels.launch import dependent, options


@functools.cache  # asked at every eager decode launch
def supported(layout: RecordLayout, warps: int, warps_down: int) -> bool:
    """Whether the kernels cover this geometry: Q4, groups of 64, I in blocks of 8 x warps rows, H in 16 x
    warps_down."""
    return (layout.bits == 4 and (layout.group_size or 64) == 64 and layout.hidden_size % 64 == 0
            and layout.intermediate_size % 64 == 0 and 64 % (8 * warps) == 0
            and layout.hidden_size % (16 * warps_down) == 0)


@functools.cache
def _layouts(warps: int, parts: int = 1) -> dict:
    from moestream.kernels.triton.expert_mma import layouts

    return layouts(warps, parts)


@functools.cache
def _halves(warps: int):
    from triton.experimental.gluon import language as gl

    return gl.BlockedLayout([1, 2], [32, 1], [warps, 1], [1, 0])


@functools.cache
def _stages(requested: int, k: int, warps: int) -> int:
    """Copy stages in flight for rows of k columns (a stage: CHUNK groups of 16 x warps rows), 0 for all: at most
    64 KB of words a program, so that a few programs an SM hold their loads in flight."""
    from moestream.kernels.triton.expert_mma import CHUNK

    codes = 64 * CHUNK.value
    total, cap = -(-k // codes), max(2, 65536 // (codes // 2 * 16 * warps))
    stages = total if requested <= 1 else min(requested, total)
    stages = stages if stages <= cap else cap
    return 0 if stages == total else stages


def launch_decode_mma(x: torch.Tensor, out: torch.Tensor, entries: torch.Tensor, addr: torch.Tensor,
                      layout: RecordLayout, top_k: int, offsets: dict, warps: int, warps_down: int,
                      records: torch.Tensor | None = None, stages: int = 0,
                      trace: tuple | None = None, trigger: int = 0) -> None:
    """As expert_mlp.launch_decode (without `record_bits`), on tensor cores: x [T, H]; out [T * top_k, H].
    `stages`: copy stages (CHUNK groups) in flight a program (0 or 1: all of them, up to 64 KB of words). `trigger`:
    the down kernel launches once every gate/up program has that many copy stages in (0: at their start). `trace`
    (benchmarks): int64 tensors [programs, 8] for each kernel's stamps (`stamp`)."""
    from moestream.kernels.triton.expert_mma import down_mma_kernel, gate_up_mma_kernel

    hidden, inter, o, n = layout.hidden_size, layout.intermediate_size, offsets, entries.shape[0]
    rows_block = 8 * warps  # gate (and up) rows a gate/up program
    hf = torch.empty(n, inter, dtype=torch.bfloat16, device=x.device)
    hs = torch.empty(n, inter // rows_block, 2, dtype=torch.float32, device=x.device)
    indirect = records is not None
    records = records if indirect else entries  # unread unless indirect
    field = 0x000F000F  # nibbles 0 and 4 of a word; passed at run time so that ptxas fuses mask and OR
    wait, pdl = dependent(x), dependent(x, "down")
    stamps = trace or (hs, hs)  # unread unless traced
    gate_up_mma_kernel[(n, inter // rows_block)](
        x, hf, hs, entries, addr, records, o["gate_w"], o["gate_s"], o["gate_b"], o["up_w"], o["up_s"], o["up_b"],
        field, H=hidden, I=inter, TOP_K=top_k, INDIRECT=indirect, PDL=pdl, WAIT=wait,
        STAGES=_stages(stages, hidden, warps), TRIGGER=trigger, TRACE=trace is not None, trace_ptr=stamps[0],
        HALVES=_halves(warps), **_layouts(warps), num_warps=warps, **options(wait))
    down_mma_kernel[(n, hidden // (16 * warps_down))](
        hf, hs, out, entries, addr, records, o["down_w"], o["down_s"], o["down_b"], field, H=hidden, I=inter,
        PARTS=64 // rows_block, INDIRECT=indirect, PDL=pdl,
        STAGES=_stages(stages, inter, warps_down), TRACE=trace is not None, trace_ptr=stamps[1],
        **_layouts(warps_down, 64 // rows_block),
        num_warps=warps_down, **options(pdl))
