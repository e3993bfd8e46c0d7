"""Launching the Triton decode-attention kernels: one query token over a fixed-size KV cache."""

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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     scale: float, rows: torch.Tensor | None = None, gate: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """q [1, Hq, D]; k_cache, v_cache [C, Hkv, D] (contiguous); position: int64 device tensor [1]. The query
    attends to cache rows 0..position inclusive, or to the cache rows `rows` [S] (int64, -1 for none). Returns
    [1, Hq, D] in q's dtype, times sigmoid(gate [1, Hq, D], any head stride) where given. GQA: query head h reads
    kv head h // (Hq // Hkv). No host sync: the launch is the same at every position (CUDA-graph safe)."""
    from moestream.kernels.triton import decode_attention as kernels

    _, hq, d = q.shape
    c, hkv, _ = k_cache.shape
    assert d in (16, 32, 64, 128, 256) and hq % hkv == 0 and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and position.dtype == torch.int64
    g = hq // hkv
    entries, block_n, split = (c, BLOCK_N, BLOCK_SPLIT) if rows is None else (rows.shape[0], ROWS_BLOCK_N, ROWS_SPLIT)
    count, length = splits(entries, block_n, split)
    q = q.contiguous()
    acc = torch.empty(hq, count, d, dtype=torch.float32, device=q.device)
    m = torch.empty(hq, count, dtype=torch.float32, device=q.device)
    l = torch.empty(hq, count, dtype=torch.float32, device=q.device)
    kernels.decode_attention_split_kernel[(hkv, count)](
        q, k_cache, v_cache, position, position if rows is None else rows, acc, m, l, scale * math.log2(math.e),
        entries, HKV=hkv, G=g, D=d, GP=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n, SPLIT_LEN=length,
        SPLITS=count, ROWS=rows is not None, num_warps=4 if d <= 128 else 8)
    out = torch.empty(1, hq, d, dtype=q.dtype, device=q.device)
    if gate is not None:
        assert gate.shape == out.shape and gate.stride(-1) == 1
    kernels.decode_attention_combine_kernel[(hq,)](acc, m, l, out if gate is None else gate, out,
                                                   d if gate is None else gate.stride(1), D=d, SPLITS=count,
                                                   SPLITS_P=triton.next_power_of_2(count), GATE=gate is not None,
                                                   num_warps=1)
    return out
