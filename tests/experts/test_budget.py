"""Sizing the pool from free GPU memory leaves room for what the engine makes later (the batch slots' states)."""

import torch

from moestream.config import ExpertConfig
from moestream.experts.budget import pool_slots_for
from moestream.experts.store import open_store


def test_a_pool_from_free_memory_leaves_the_reserved_bytes(tiny, monkeypatch):
    store = open_store(tiny.store("qwen3_moe"))
    stride = store.manifest.layouts["q4"].stride
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(30e9), int(80e9)))
    cfg, cuda = ExpertConfig(), torch.device("cuda")
    total = store.manifest.geometry.num_records
    spare = 30e9 - 3e9 - cfg.ring_slots * stride  # free, less the headroom and the ring
    reserved = spare - 5 * stride  # room for five records beside it
    assert pool_slots_for(store, cfg, cuda, 2, stride) == total
    assert pool_slots_for(store, cfg, cuda, 2, stride, reserved=int(reserved)) == 5
