"""QSA block selection, vectorised over queries, against a per-query loop written as transformers does it,
on scores with many exact ties (one indexer head: relu zeroes about half the blocks)."""

import json
import math
import os

import torch

from moestream.config import ModelConfig
from moestream.layers.qsa import Indexer


def reference_tokens(q, blocks, p, ratio, block_topk) -> set[int]:
    """The tokens query position p attends to: its best complete blocks, plus its incomplete block."""
    complete = (p + 1) // ratio
    chosen = []
    if complete:
        scores = torch.relu(torch.matmul(q.float(), blocks[:complete].float().T).T).sum(-1) / math.sqrt(q.shape[-1])
        chosen = scores.topk(min(block_topk, complete), dim=0).indices.tolist()
    tokens = {b * ratio + i for b in chosen for i in range(ratio)}
    return tokens | set(range(complete * ratio, p + 1))


def test_selection_matches_per_query_topk_with_ties(tiny):
    with open(os.path.join(tiny.checkpoint("qwen4_exp"), "config.json")) as f:
        cfg = ModelConfig.from_hf({**json.load(f), "indexer_n_heads": 1, "indexer_budget": 12})
    indexer = Indexer(cfg)
    gen = torch.Generator().manual_seed(0)
    length, ratio = 150, cfg.indexer_compress_ratio
    blocks = torch.randn(length // ratio, cfg.indexer_head_dim, generator=gen)
    q = torch.randn(length, 1, cfg.indexer_head_dim, generator=gen)
    positions = torch.arange(length)
    ids, ok = indexer.select(q, blocks, positions)
    for p in range(length):
        got = set(ids[p][ok[p]].tolist())
        assert len(got) == ok[p].sum()  # no token twice
        assert got == reference_tokens(q[p, 0][None], blocks, p, ratio, indexer.block_topk), p
