"""Launching the Triton decode-attention kernels: query tokens, each over a fixed-size KV cache, stored in place
or paged (a row map per sequence: one for all the tokens, or a batch's, each token its own sequence's)."""

from __future__ import annotations

import math

import torch
import triton

from moestream.kernels.launch import arrival_counts

BLOCK_N = 64  # positions per inner step of the split kernel
# over listed rows (QSA's ~2k): 32 a step, as the indices take registers that 64 would spill at D 256, and short
# splits, so that a few kv heads still spread over the SMs
ROWS_BLOCK_N, ROWS_SPLIT = 32, 64
BLOCK_SPLIT = 256  # positions per split, before rounding (the split count is capped at MAX_SPLITS)
MAX_SPLITS = 64
COUNTS = 1 << 14  # (token, kv head) pairs a launch may count splits for
# programs a launch aims at: a batch's short caches leave most splits empty, and a program per split then costs
# more than the attention (16 rows of the 30B: 2048 programs)
PROGRAMS = 512


def splits(capacity: int, block_n: int = BLOCK_N, block_split: int = BLOCK_SPLIT) -> tuple[int, int]:
    """(SPLITS, positions per split, a multiple of block_n), from the cache capacity alone."""
    count = min(MAX_SPLITS, triton.cdiv(capacity, block_split))
    length = triton.cdiv(triton.cdiv(capacity, count), block_n) * block_n
    return triton.cdiv(capacity, length), length


def map_offsets(maps: list[torch.Tensor]) -> torch.Tensor:
    """Where each row map starts, in elements past the first one's [T] (int64, on their device), made once for a
    set of maps and kept: a captured graph reads it (the first, eager run of a step makes it, before the capture)."""
    key = tuple(m.data_ptr() for m in maps)
    if key not in _OFFSETS:
        size = maps[0].element_size()
        _OFFSETS[key] = torch.tensor([(p - key[0]) // size for p in key], device=maps[0].device)
    return _OFFSETS[key]


def map_args(maps: torch.Tensor | list[torch.Tensor] | None, position: torch.Tensor) -> tuple:
    """(map, its offsets per token, MAP, OFFSETS) for the kernels: no map (positions are rows), one for every token,
    or each token its own."""
    if maps is None:
        return position, position, False, False
    if isinstance(maps, list):
        assert all(m.dtype == torch.int64 and m.shape == maps[0].shape for m in maps)
        return maps[0], map_offsets(maps), True, True
    assert maps.dtype == torch.int64
    return maps, position, True, False


_OFFSETS: dict[tuple[int, ...], torch.Tensor] = {}


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     scale: float, rows: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                     maps: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [N, Hkv, D] (contiguous); position: int64 device tensor [T]. Token t attends
    to its positions 0..position[t] inclusive, or (T = 1) to the positions `rows` [S] (int64, -1 for none).
    Position p is cache row p, or with `maps` (a paged cache: int64 [C], one for every token, or a list of T) row
    maps[t][p]; C (N without maps) sets the split, so it must not change between steps a graph replays. Returns
    [T, Hq, D] in q's dtype, times sigmoid(gate [T, Hq, D], any row and head stride) where given. GQA: query head h
    reads kv head h // (Hq // Hkv). No host sync: the launch is the same at every position (CUDA-graph safe)."""
    from moestream.kernels.triton import decode_attention as kernels

    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert d in (16, 32, 64, 128, 256) and hq % hkv == 0 and (rows is None or t == 1)
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert position.dtype == torch.int64 and position.numel() == t
    assert not isinstance(maps, list) or len(maps) == t
    row_map, offsets, mapped, per_token = map_args(maps, position)
    c = row_map.shape[-1] if mapped else k_cache.shape[0]
    g = hq // hkv
    entries, block_n, split = (c, BLOCK_N, BLOCK_SPLIT) if rows is None else (rows.shape[0], ROWS_BLOCK_N, ROWS_SPLIT)
    count, length = splits(entries, block_n, split)
    q = q.contiguous()
    acc = torch.empty(t, hq, count, d, dtype=torch.float32, device=q.device)
    m = torch.empty(t, hq, count, dtype=torch.float32, device=q.device)
    l = torch.empty(t, hq, count, dtype=torch.float32, device=q.device)
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if gate is not None:
        assert gate.shape == out.shape and gate.stride(-1) == 1
    assert t * hkv <= COUNTS
    programs = min(count, triton.cdiv(PROGRAMS, hkv * t))  # each takes every programs-th split
    kernels.decode_attention_split_kernel[(hkv, programs, t)](
        q, k_cache, v_cache, row_map, offsets, position, position if rows is None else rows, acc, m, l,
        arrival_counts("decode_attention", COUNTS, q.device), out if gate is None else gate, out,
        d if gate is None else gate.stride(1), hq * d if gate is None else gate.stride(0),
        scale * math.log2(math.e), entries, programs, HKV=hkv, G=g, D=d, GP=max(16, triton.next_power_of_2(g)),
        BLOCK_N=block_n, SPLIT_LEN=length, SPLITS=count, ROWS=rows is not None, MAP=mapped, OFFSETS=per_token,
        GATE=gate is not None, num_warps=4 if d <= 128 else 8)
    return out
