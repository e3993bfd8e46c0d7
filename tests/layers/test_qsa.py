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


def test_static_selection_equals_eager_and_breaks_ties_by_block_index(tiny):
    """The static step scores every block row of the reserved cache (masked by the position): without ties it
    chooses what the eager selection does; with them (one head: relu zeroes half the blocks), the lower index."""
    with open(os.path.join(tiny.checkpoint("qwen4_exp"), "config.json")) as f:
        hf = json.load(f)
    gen = torch.Generator().manual_seed(1)
    for heads in (8, 1):
        cfg = ModelConfig.from_hf({**hf, "indexer_n_heads": heads, "indexer_budget": 12})
        indexer, ratio = Indexer(cfg), cfg.indexer_compress_ratio
        length, capacity_blocks = 150, 64
        blocks = torch.randn(capacity_blocks, cfg.indexer_head_dim, generator=gen)
        q = torch.randn(length, heads, cfg.indexer_head_dim, generator=gen)
        eager_ids, eager_ok = indexer.select(q, blocks[: length // ratio], torch.arange(length))
        for p in range(length):
            rows = indexer.select_static(q[p][None], blocks, torch.tensor([p]))
            assert rows.shape == (indexer.block_topk * ratio + ratio - 1,)
            got = set(rows[rows >= 0].tolist())
            assert len(got) == (rows >= 0).sum()
            if heads > 1:
                assert got == set(eager_ids[p][eager_ok[p]].tolist()), p
                continue
            complete = (p + 1) // ratio
            scores = indexer.scores(q[p][None], blocks[:complete])[0]
            order = sorted(range(complete), key=lambda b: (-scores[b].item(), b))[: indexer.block_topk]
            want = {b * ratio + i for b in order for i in range(ratio)} | set(range(complete * ratio, p + 1))
            assert got == want, p
