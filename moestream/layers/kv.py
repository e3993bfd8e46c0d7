"""Paged KV caches. An attention layer's keys and values live in a row store that the sequences of a decoder
share, handed out in blocks of BLOCK_ROWS positions; a sequence has one block table for all its layers, whose row
map (position -> store row, on the device) the decode kernels and the eager path read. Memory follows use: a
sequence holds the blocks its positions fill, and gives them back when it ends.

A pool that no budget bounds grows by doubling (its stores move, so graphs captured over them are made anew); a
bounded one refuses past its blocks (KVFull), and the scheduler admits a sequence only when the blocks it may
need are free. A cache of its own (the eager path, tests) is a pool of one sequence that grows.

Blocks are counted: the prefix cache keeps a prompt's blocks (`BlockTable.shared`) and a sequence that repeats
the prompt starts from them (`adopt`), with no row copied; a bounded pool short of blocks first asks its `reclaim`
(the prefix cache) to give some back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK_ROWS = 16  # positions a block holds


class KVFull(RuntimeError):
    pass


def blocks_for(rows: int) -> int:
    return -(-rows // BLOCK_ROWS)


class KVRows:
    """One attention layer's key and value rows [rows, kv_heads, head_dim]; zeros, not garbage: a reference step
    may meet an unwritten row in softmax @ V, where 0 * NaN would be NaN."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, rows: int = 0):
        self.k = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def grow(self, rows: int) -> None:
        extra = rows - self.k.shape[0]
        self.k = torch.cat([self.k, self.k.new_zeros(extra, *self.k.shape[1:])])
        self.v = torch.cat([self.v, self.v.new_zeros(extra, *self.v.shape[1:])])


class BlockPool:
    """The blocks of a set of stores (one per attention layer; block b is rows b * BLOCK_ROWS.. of each)."""

    def __init__(self, stores: list[KVRows], blocks: int, bounded: bool):
        self.stores, self.blocks, self.bounded = stores, blocks, bounded
        for store in stores:
            store.grow(blocks * BLOCK_ROWS)
        self.free = list(range(blocks - 1, -1, -1))  # taken from the end: the lowest ids first
        self.holders = [0] * blocks  # tables and cached prefixes holding each block
        self.grown = 0  # times the stores moved
        self.reclaim: Callable[[int], None] | None = None  # asked for blocks back before a bounded pool refuses

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    @property
    def block_bytes(self) -> int:
        return sum(2 * s.k[:BLOCK_ROWS].numel() * s.k.element_size() for s in self.stores)

    def take(self, n: int) -> list[int]:
        if n > len(self.free) and self.bounded and self.reclaim is not None:
            self.reclaim(n - len(self.free))
        if n > len(self.free):
            if self.bounded:
                raise KVFull(f"the KV cache's {self.blocks} blocks of {BLOCK_ROWS} positions are all in use")
            self._grow(max(2 * self.blocks, self.blocks + n - len(self.free)))
        taken = self.free[len(self.free) - n:][::-1]
        del self.free[len(self.free) - n:]
        self.hold(taken)
        return taken

    def hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self.holders[b] += 1

    def give(self, blocks: list[int]) -> None:
        """One holder lets go of each of `blocks`; those nobody holds are free."""
        freed = []
        for b in blocks:
            self.holders[b] -= 1
            if not self.holders[b]:
                freed.append(b)
        self.free.extend(reversed(freed))

    def _grow(self, blocks: int) -> None:
        for store in self.stores:
            store.grow(blocks * BLOCK_ROWS)
        self.free[:0] = range(blocks - 1, self.blocks - 1, -1)
        self.holders += [0] * (blocks - self.blocks)
        self.blocks, self.grown = blocks, self.grown + 1


class BlockTable:
    """A sequence's blocks in a pool, and its row map: position p -> store row, [capacity] int64 on the device (the
    capacity, not the blocks held, sets a static step's shapes)."""

    def __init__(self, pool: BlockPool, device: torch.device, capacity: int):
        self.pool, self.blocks = pool, []
        self.row_map = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.adopted: list[int] | None = None  # the cached prefix's blocks it started from (once for every layer)

    @property
    def capacity(self) -> int:
        return self.row_map.shape[0]

    @torch.inference_mode()  # grown in a forward (an inference tensor), written outside one too
    def reserve(self, capacity: int) -> None:
        """A map of `capacity` positions (a new tensor: graphs over the old one are made anew)."""
        if capacity > self.capacity:
            self.row_map = self.row_map.new_zeros(capacity)
            self._write(0)

    def ensure(self, end: int) -> None:
        """Blocks for positions up to `end` (the map must cover them)."""
        assert end <= self.capacity
        if (need := blocks_for(end) - len(self.blocks)) > 0:
            first = len(self.blocks)
            self.blocks += self.pool.take(need)
            self._write(first)

    def take_over(self, other: BlockTable) -> None:
        """Become `other`'s blocks, which it gives up (a sequence moved to another batch slot: no row is copied)."""
        self.release()
        self.blocks, other.blocks = other.blocks, []
        self.adopted, other.adopted = other.adopted, None
        self._write(0)

    def release(self) -> None:
        self.pool.give(self.blocks)
        self.blocks, self.adopted = [], None

    def shared(self, length: int) -> list[int]:
        """The blocks of positions 0..length, held once more for a cached prefix (which gives them back)."""
        blocks = self.blocks[: blocks_for(length)]
        self.pool.hold(blocks)
        return blocks

    @torch.inference_mode()
    def adopt(self, blocks: list[int], length: int) -> None:
        """Start from a cached prefix's blocks (positions 0..length), held, not copied; a partly filled last block
        is copied into one of its own, since this sequence writes on after `length`."""
        self.release()
        full = length // BLOCK_ROWS
        self.blocks = blocks[:full]
        self.pool.hold(self.blocks)
        if length % BLOCK_ROWS:
            own = self.pool.take(1)
            rows, to = (torch.tensor([blocks[full], own[0]])[:, None] * BLOCK_ROWS + torch.arange(BLOCK_ROWS)).to(
                self.row_map.device)
            for store in self.pool.stores:
                store.k[to], store.v[to] = store.k[rows], store.v[rows]
            self.blocks = self.blocks + own
        self.adopted = blocks
        self._write(0)

    @torch.inference_mode()
    def _write(self, first: int) -> None:
        """The map's entries for blocks[first:]."""
        start = first * BLOCK_ROWS
        if start >= self.capacity or first >= len(self.blocks):
            return
        ids = torch.tensor(self.blocks[first:], dtype=torch.int64)
        rows = (ids[:, None] * BLOCK_ROWS + torch.arange(BLOCK_ROWS)).flatten()[: self.capacity - start]
        if self.row_map.is_cuda:  # no host wait, so a decode step in flight (Decoder.step_ahead) keeps the GPU busy
            rows = rows.pin_memory()
        self.row_map[start: start + rows.shape[0]].copy_(rows, non_blocking=self.row_map.is_cuda)


@dataclass
class KVSnapshot:
    """A cache's used rows, in order (perhaps on the host), or the pool blocks that hold them (`blocks`, held by
    whoever keeps the snapshot), and the map capacity it had."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    length: int
    capacity: int
    blocks: list[int] | None


class KVCache:
    """One layer's keys and values for one sequence: rows of a store (its own, or a pool's that other sequences
    share: `share`) found through the sequence's block table."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 64):
        self.store = KVRows(kv_heads, head_dim, dtype, device)
        self.table = BlockTable(BlockPool([self.store], 0, bounded=False), device, capacity)
        self.length = 0

    def share(self, store: KVRows, table: BlockTable) -> None:
        """Keep rows in `store` through `table` (a pool's, shared by the sequence's layers) from now on."""
        self.table.release()
        self.store, self.table = store, table

    @property
    def k(self) -> torch.Tensor:
        return self.store.k

    @property
    def v(self) -> torch.Tensor:
        return self.store.v

    @property
    def row_map(self) -> torch.Tensor:
        """The row map [capacity]: position p's keys are k[row_map[p]]."""
        return self.table.row_map

    @property
    def capacity(self) -> int:
        return self.table.capacity

    def reserve(self, capacity: int) -> None:
        """A map of `capacity` positions (static decode needs buffers that never move); blocks come with use."""
        self.table.reserve(capacity)

    def make_room(self, end: int) -> None:
        """Blocks for positions up to `end`, the map grown by doubling (eager steps grow one row at a time)."""
        if end > self.capacity:
            self.reserve(max(end, 2 * self.capacity))
        self.table.ensure(end)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v [T, kv_heads, head_dim] after the first `length` positions; returns every position's up to
        them, in order. The length moves on with the sequence (`advance`)."""
        start, end = self.length, self.length + k.shape[0]
        self.make_room(end)
        at = self.row_map[start:end]
        self.store.k.index_copy_(0, at, k)
        self.store.v.index_copy_(0, at, v)
        if start == 0:  # a whole prompt: its own rows, the bits the store now holds
            return k, v
        return self.keys_values(end)

    def keys_values(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions 0..end, in order."""
        every = self.row_map[:end]
        return self.store.k[every], self.store.v[every]

    @torch.inference_mode()
    def clear(self, start: int, end: int) -> None:
        """Zero positions start..end (rows a step attends to but never wrote)."""
        self.make_room(end)
        self.store.k.index_fill_(0, self.row_map[start:end], 0)
        self.store.v.index_fill_(0, self.row_map[start:end], 0)

    def advance(self, rows: int) -> None:
        self.length += rows

    def reset(self) -> None:
        """Empty: its blocks go back to the pool, the map stays (a captured graph reads it)."""
        self.length = 0
        self.table.release()

    @torch.inference_mode()  # stores grown in a forward are inference tensors
    def load(self, other: KVCache | KVSnapshot) -> None:
        """Become `other` in place: a snapshot's rows copied in, or a live cache of the same store taken over
        (blocks, not rows: its sequence moved slots)."""
        if isinstance(other, KVCache) and other.store is self.store:
            if other.table is not self.table and other.table.blocks:  # once for the sequence's layers
                self.table.take_over(other.table)
        elif isinstance(other, KVSnapshot) and other.blocks is not None:
            if self.table.adopted is not other.blocks:  # once for the sequence's layers
                self.reserve(other.length)
                self.table.adopt(other.blocks, other.length)
        else:
            other = other.snapshot() if isinstance(other, KVCache) else other
            self.make_room(other.length)
            at = self.row_map[: other.length]
            self.store.k.index_copy_(0, at, other.k[: other.length].to(self.k.device))
            self.store.v.index_copy_(0, at, other.v[: other.length].to(self.v.device))
        self.length = other.length

    def snapshot(self, blocks: list[int] | None = None) -> KVSnapshot:
        """Its rows copied out, or with `blocks` (its table's, held for the snapshot: `BlockTable.shared`) left
        where they are."""
        if blocks is not None:
            return KVSnapshot(None, None, self.length, self.capacity, blocks)
        at = self.row_map[: self.length]
        return KVSnapshot(self.store.k[at], self.store.v[at], self.length, self.capacity, None)
