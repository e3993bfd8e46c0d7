"""Launching the Triton decode-attention kernels: query tokens, each over a fixed-size KV cache (one for all of
them, or a batch's: each token its own sequence's)."""

from __future__ import annotations

import math

import torch
import triton

BLOCK_N = 64  # positions per inner step of the split kernel
# over listed rows (QSA's ~2k): 32 a step, as the indices take registers that 64 would spill at D 256, and short
# splits, so that a few kv heads still spread over the SMs
ROWS_BLOCK_N, ROWS_SPLIT = 32, 64
BLOCK_SPLIT = 256  # positions per split, before rounding (the split count is capped at MAX_SPLITS)
MAX_SPLITS = 64


def splits(capacity: int, block_n: int = BLOCK_N, block_split: int = BLOCK_SPLIT) -> tuple[int, int]:
    """(SPLITS, positions per split, a multiple of block_n), from the cache capacity alone."""
    count = min(MAX_SPLITS, triton.cdiv(capacity, block_split))
    length = triton.cdiv(triton.cdiv(capacity, count), block_n) * block_n
    return triton.cdiv(capacity, length), length


def row_offsets(caches: list[torch.Tensor]) -> torch.Tensor:
    """Where each cache starts, in elements past the first one's [T] (int64, on their device), made once for a set
    of caches and kept: a captured graph reads it (the first, eager run of a step makes it, before the capture)."""
    key = tuple(c.data_ptr() for c in caches)
    if key not in _OFFSETS:
        size = caches[0].element_size()
        _OFFSETS[key] = torch.tensor([(p - key[0]) // size for p in key], device=caches[0].device)
    return _OFFSETS[key]


_OFFSETS: dict[tuple[int, ...], torch.Tensor] = {}


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor | list[torch.Tensor],
                     v_cache: torch.Tensor | list[torch.Tensor], position: torch.Tensor, scale: float,
                     rows: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [C, Hkv, D] (contiguous), one for every token or a list of T of one shape;
    position: int64 device tensor [T]. Token t attends to its cache's rows 0..position[t] inclusive, or (T = 1) to
    the cache rows `rows` [S] (int64, -1 for none). Returns [T, Hq, D] in q's dtype, times sigmoid(gate [T, Hq, D],
    any row and head stride) where given. GQA: query head h reads kv head h // (Hq // Hkv). No host sync: the
    launch is the same at every position (CUDA-graph safe)."""
    from moestream.kernels.triton import decode_attention as kernels

    t, hq, d = q.shape
    ks, vs = (k_cache, v_cache) if isinstance(k_cache, list) else ([k_cache], [v_cache])
    c, hkv, _ = ks[0].shape
    assert d in (16, 32, 64, 128, 256) and hq % hkv == 0 and len(ks) in (1, t) and (rows is None or t == 1)
    assert all(k.shape == ks[0].shape == v.shape and k.is_contiguous() and v.is_contiguous() for k, v in zip(ks, vs))
    assert position.dtype == torch.int64 and position.numel() == t
    offsets = (row_offsets(ks), row_offsets(vs)) if len(ks) > 1 else (position, position)
    g = hq // hkv
    entries, block_n, split = (c, BLOCK_N, BLOCK_SPLIT) if rows is None else (rows.shape[0], ROWS_BLOCK_N, ROWS_SPLIT)
    count, length = splits(entries, block_n, split)
    q = q.contiguous()
    acc = torch.empty(t, hq, count, d, dtype=torch.float32, device=q.device)
    m = torch.empty(t, hq, count, dtype=torch.float32, device=q.device)
    l = torch.empty(t, hq, count, dtype=torch.float32, device=q.device)
    kernels.decode_attention_split_kernel[(hkv, count, t)](
        q, ks[0], vs[0], *offsets, position, position if rows is None else rows, acc, m, l,
        scale * math.log2(math.e), entries, HKV=hkv, G=g, D=d, GP=max(16, triton.next_power_of_2(g)),
        BLOCK_N=block_n, SPLIT_LEN=length, SPLITS=count, ROWS=rows is not None, OFFSETS=len(ks) > 1,
        num_warps=4 if d <= 128 else 8)
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if gate is not None:
        assert gate.shape == out.shape and gate.stride(-1) == 1
    kernels.decode_attention_combine_kernel[(hq, t)](
        acc, m, l, out if gate is None else gate, out, d if gate is None else gate.stride(1),
        hq * d if gate is None else gate.stride(0), hq, D=d, SPLITS=count, SPLITS_P=triton.next_power_of_2(count),
        GATE=gate is not None, num_warps=1)
    return out
