"""Launching the Triton decode-attention kernels: one query token over a fixed-size KV cache."""

from __future__ import annotations

import math

import torch
import triton

BLOCK_N = 64  # positions per inner step of the split kernel
BLOCK_SPLIT = 256  # positions per split, before rounding (the split count is capped at MAX_SPLITS)
MAX_SPLITS = 64


def splits(capacity: int) -> tuple[int, int]:
    """(SPLITS, positions per split, a multiple of BLOCK_N), from the cache capacity alone."""
    count = min(MAX_SPLITS, triton.cdiv(capacity, BLOCK_SPLIT))
    length = triton.cdiv(triton.cdiv(capacity, count), BLOCK_N) * BLOCK_N
    return triton.cdiv(capacity, length), length


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [1, Hq, D]; k_cache, v_cache [C, Hkv, D] (contiguous); position: int64 device tensor [1]. The query
    attends to cache rows 0..position inclusive. Returns [1, Hq, D] in q's dtype. GQA: query head h reads kv
    head h // (Hq // Hkv). No host sync: the launch is the same at every position (CUDA-graph safe)."""
    from moestream.kernels.triton import decode_attention as kernels

    _, hq, d = q.shape
    c, hkv, _ = k_cache.shape
    assert d in (16, 32, 64, 128, 256) and hq % hkv == 0 and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and position.dtype == torch.int64
    g = hq // hkv
    count, length = splits(c)
    q = q.contiguous()
    acc = torch.empty(hq, count, d, dtype=torch.float32, device=q.device)
    m = torch.empty(hq, count, dtype=torch.float32, device=q.device)
    l = torch.empty(hq, count, dtype=torch.float32, device=q.device)
    kernels.decode_attention_split_kernel[(hkv, count)](
        q, k_cache, v_cache, position, acc, m, l, scale * math.log2(math.e), c, HKV=hkv, G=g, D=d,
        GP=max(16, triton.next_power_of_2(g)), BLOCK_N=BLOCK_N, SPLIT_LEN=length, SPLITS=count,
        num_warps=4 if d <= 128 else 8)
    out = torch.empty(1, hq, d, dtype=q.dtype, device=q.device)
    kernels.decode_attention_combine_kernel[(hq,)](acc, m, l, out, D=d, SPLITS=count,
                                                   SPLITS_P=triton.next_power_of_2(count), num_warps=1)
    return out
