"""Paged KV caches (layers/kv.py): a sequence's positions live in blocks of a shared store, found through its row
map; blocks are taken as positions fill and go back when the sequence ends or moves."""

import pytest
import torch

from moestream.layers.kv import BLOCK_ROWS, BlockPool, BlockTable, KVCache, KVFull, KVRows


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)


def _shared(blocks: int, bounded: bool, sequences: int = 2):
    pool = BlockPool([KVRows(2, 8, torch.float32, torch.device("cpu"))], blocks, bounded)
    caches = []
    for _ in range(sequences):
        cache = KVCache(2, 8, torch.float32, torch.device("cpu"))
        cache.share(pool.stores[0], BlockTable(pool, torch.device("cpu"), 64))
        caches.append(cache)
    return pool, caches


def test_interleaved_sequences_read_back_their_own_rows_in_order():
    pool, (a, b) = _shared(8, bounded=True)
    ka, va = _rows(40, 0)
    kb, vb = _rows(20, 1)
    for start in range(0, 40, 10):  # chunks of the two sequences take blocks in turn
        got = a.append(ka[start: start + 10], va[start: start + 10])
        a.advance(10)
        assert torch.equal(got[0], ka[: start + 10]) and torch.equal(got[1], va[: start + 10])
        if start < 20:
            b.append(kb[start: start + 10], vb[start: start + 10])
            b.advance(10)
    assert len(a.table.blocks) == 3 and len(b.table.blocks) == 2 and pool.used == 5  # 40 and 20 positions
    assert not set(a.table.blocks) & set(b.table.blocks)
    assert torch.equal(b.snapshot().k, kb) and torch.equal(a.k[a.row_map[:40]], ka)


def test_blocks_go_back_when_a_sequence_ends_and_move_without_a_copy():
    pool, (a, b) = _shared(4, bounded=True)
    k, v = _rows(30, 2)
    a.append(k, v)
    a.advance(30)
    held, store = list(a.table.blocks), a.k.clone()
    b.load(a)  # a's sequence moved to b's slot: b's table takes its blocks
    assert b.table.blocks == held and a.table.blocks == [] and b.length == 30
    assert torch.equal(a.k, store) and torch.equal(b.snapshot().k, k)
    b.reset()
    assert pool.used == 0 and len(pool.free) == 4


def test_a_bounded_pool_refuses_past_its_blocks_and_an_unbounded_one_grows():
    pool, (a, _) = _shared(2, bounded=True)
    k, v = _rows(2 * BLOCK_ROWS + 1, 3)
    with pytest.raises(KVFull, match="2 blocks"):
        a.append(k, v)
    own = KVCache(2, 8, torch.float32, torch.device("cpu"))
    own.append(k, v)
    own.advance(k.shape[0])
    assert own.table.pool.blocks >= 3 and own.table.pool.grown >= 1 and torch.equal(own.snapshot().k, k)


def test_a_snapshot_loads_into_another_pool():
    _, (a, _) = _shared(4, bounded=True)
    k, v = _rows(21, 4)
    a.append(k, v)
    a.advance(21)
    own = KVCache(2, 8, torch.float32, torch.device("cpu"))
    own.load(a.snapshot())
    assert own.length == 21 and torch.equal(own.snapshot().v, v)
    other = KVCache(2, 8, torch.float32, torch.device("cpu"))
    other.load(a)  # a live cache of another store: its rows are copied
    assert torch.equal(other.snapshot().k, k) and len(a.table.blocks) == 2
