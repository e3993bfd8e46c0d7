"""Launching the Q4 prefill expert MLP on Hopper's warpgroup MMA (triton/expert_wgmma.py, Gluon) where a tile
config asks for it (`TileConfig.wgmma`) and it applies; expert_mlp.launch_prefill runs its Triton tiles otherwise."""

from __future__ import annotations

import functools

import torch

from moestream.experts.format import RecordLayout


@functools.cache
def _hopper(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401 (Triton 3.5+)
    except ImportError:
        return False
    return True


@functools.cache
def _layouts(bm: int, num_warps: int) -> dict:
    from moestream.kernels.triton.expert_wgmma import layouts

    return layouts(bm, num_warps)


def applies(cfg, layout: RecordLayout, *tensors: torch.Tensor) -> bool:
    """Whether the warpgroup-MMA kernels take these tiles: Q4 in groups of 64, bf16 rows 16-byte aligned (their
    async copies move 16 bytes), a matrix's rows a whole number of BN = 16 x num_warps weight rows, on Hopper."""
    rows = 16 * cfg.num_warps
    return bool(cfg.wgmma and layout.bits == 4 and layout.group_size == 64 and cfg.bm in (64, 128, 256)
                and cfg.num_warps in (4, 8) and cfg.num_stages >= 3 and layout.hidden_size % rows == 0
                and layout.intermediate_size % max(64, rows // 2) == 0
                and all(t.is_cuda and t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0 for t in tensors)
                and _hopper(tensors[0].device.index or 0))


def launch(x: torch.Tensor, h: torch.Tensor, out: torch.Tensor, entries: torch.Tensor, tile_addr: torch.Tensor,
           tile_start: torch.Tensor, tile_count: torch.Tensor, layout: RecordLayout, offsets: dict, top_k: int, cfg,
           sparse: bool) -> None:
    """expert_mlp.launch_prefill's tiles (its tables, `h` and `out`) through the warpgroup-MMA kernels."""
    from moestream.kernels.triton.expert_wgmma import FIELD, down_kernel, gate_up_kernel

    shapes, o = _layouts(cfg.bm, cfg.num_warps), offsets
    hidden, inter, tiles, bn = layout.hidden_size, layout.intermediate_size, tile_addr.shape[0], shapes["BN"]
    common = dict(H=hidden, I=inter, BM=cfg.bm, STAGES=cfg.num_stages, SPARSE=sparse, num_warps=cfg.num_warps,
                  **shapes)
    gate_up_kernel[(tiles, inter // (bn // 2))](
        x, h, entries, tile_addr, tile_start, tile_count, o["gate_w"], o["gate_s"], o["gate_b"], o["up_w"],
        o["up_s"], o["up_b"], FIELD, TOP_K=top_k, **common)
    down_kernel[(tiles, hidden // bn)](
        h, out, entries, tile_addr, tile_start, tile_count, o["down_w"], o["down_s"], o["down_b"], FIELD, **common)
