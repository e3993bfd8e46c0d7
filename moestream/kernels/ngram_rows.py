"""Launching PLE's n-gram kernels, the row ids' hashing and the row gather: one launch each, no host synchronisation,
so they can sit in a CUDA graph (the table's address is baked into the graph; the ids are read on the device at
each replay)."""

from __future__ import annotations

import torch
import triton

from moestream.experts.format import NgramLayout


def ngram_rows(table: torch.Tensor, ids: torch.Tensor, layout: NgramLayout, dtype: torch.dtype) -> torch.Tensor:
    """reference.ngram_rows: table uint8 [rows, >= row_bytes] in device or pinned host memory (rows contiguous),
    ids [...] int64 on the device -> [..., dim] in `dtype`; an id outside [0, rows) gives a zero row."""
    from moestream.kernels.triton.ngram_rows import ngram_rows_kernel

    if table.dtype != torch.uint8 or table.dim() != 2 or table.stride(1) != 1 or table.shape[1] < layout.row_bytes:
        raise ValueError(f"n-gram table must be uint8 [rows, {layout.row_bytes}] with contiguous rows, "
                         f"got {table.dtype} {tuple(table.shape)}")
    if ids.device.type == "cuda" and table.device.type == "cpu" and not table.is_pinned():
        raise ValueError("an n-gram table on the host must be pinned for the GPU to read it in place")
    out = torch.empty(*ids.shape, layout.dim, dtype=dtype, device=ids.device)
    flat = ids.reshape(-1)
    if flat.numel():
        ngram_rows_kernel[(flat.numel(),)](table.data_ptr(), table.stride(0), table.shape[0], flat, out,
                                           DIM=layout.dim, Q4=layout.precision == "q4",
                                           GROUP=max(layout.group_size, 1), BLOCK=triton.next_power_of_2(layout.dim),
                                           num_warps=4 if layout.dim >= 1024 else 1)
    return out


def ngram_ids(ids: torch.Tensor, context: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor,
              offsets: torch.Tensor, heads_per_ngram: int, eos: int) -> torch.Tensor:
    """reference.ngram_ids in one launch, a program a token: ids [T], context [n - 1] int64 on one device ->
    [T, heads] int64."""
    from moestream.kernels.triton.ngram_rows import ngram_ids_kernel

    n, heads = multipliers.shape[0], sizes.shape[0]
    assert context.shape[0] == n - 1 and heads == (n - 1) * heads_per_ngram and multipliers.dtype == torch.int64
    out = torch.empty(ids.shape[0], heads, dtype=torch.int64, device=ids.device)
    if ids.shape[0]:
        ngram_ids_kernel[(ids.shape[0],)](ids.contiguous(), context.contiguous(), multipliers, sizes, offsets, out,
                                          eos, C=n - 1, HPN=heads_per_ngram, HEADS=heads,
                                          N_BLOCK=triton.next_power_of_2(n), H_BLOCK=triton.next_power_of_2(heads),
                                          num_warps=1)
    return out
