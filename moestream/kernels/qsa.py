"""Launching QSA's decode-step kernels (reference.qsa_block_key, qsa_scores, qsa_rows)."""

from __future__ import annotations

import torch
import triton

SCORE_BLOCKS = 32  # block rows a scoring program
SELECT_CHUNK = 1024  # scores the selecting program reads at a time


def block_key(index_keys: torch.Tensor, block_keys: torch.Tensor, raw_key: torch.Tensor, position: torch.Tensor,
              ratio: int, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> None:
    from moestream.kernels.triton.qsa import block_key_kernel

    di = index_keys.shape[1]
    block_key_kernel[(1,)](raw_key.contiguous(), index_keys, block_keys, norm_weight, inv_freq, position, eps,
                           DI=di, BLOCK=triton.next_power_of_2(di), RATIO=ratio, ROT=2 * inv_freq.shape[0],
                           num_warps=1)


def scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """q [1, Hi, Di], blocks [B, Di] (contiguous rows) -> [B] float32."""
    from moestream.kernels.triton.qsa import block_scores_kernel

    _, hi, di = q.shape
    b = blocks.shape[0]
    out = torch.empty(b, dtype=torch.float32, device=q.device)
    block_scores_kernel[(triton.cdiv(b, SCORE_BLOCKS),)](q.contiguous(), blocks, out, b, di ** 0.5, HI=hi, DI=di,
                                                         BB=SCORE_BLOCKS, BD=triton.next_power_of_2(di), num_warps=4)
    return out


def rows(block_scores: torch.Tensor, position: torch.Tensor, ratio: int, block_topk: int) -> torch.Tensor:
    from moestream.kernels.triton.qsa import select_rows_kernel

    out = torch.empty(block_topk * ratio + ratio - 1, dtype=torch.int64, device=block_scores.device)
    select_rows_kernel[(1,)](block_scores, position, out, RATIO=ratio, TOPK=block_topk, CHUNK=SELECT_CHUNK,
                             RATIO_P=triton.next_power_of_2(ratio), num_warps=4)
    return out
