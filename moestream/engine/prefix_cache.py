"""Prompt prefix cache: sequence-state snapshots at fixed prefill boundaries, LRU under a byte budget.

Contract (exactness): the engine always cuts a prompt's prefill at multiples of `chunk` counted from
the first token, and this cache stores `SequenceState.snapshot()`s taken only at those boundaries. A
hit restores the deepest cached boundary that is a prefix of the new prompt and leaves at least one
prompt token to compute, so the forwards that follow are exactly the ones an uncached run makes and
the output does not depend on what was cached. A hit is copied into the new sequence's own state (the
decoder's buffers, which its captured graph reads), and attention caches get back at least the capacity they had
when the snapshot was taken (the CUDA decoder attends over the whole buffer, so its size must match).

Keys are a chain hash of token blocks (block i's key covers tokens [0, (i+1) * chunk)); a hit is also
checked token by token. With MTP drafting a snapshot holds the head's cache too, and a boundary where the head
still waits on the next token (the prompt's end) is not kept.

Where the sequences' attention caches live in the decoder's paged KV pool (`pool`), an entry keeps the prompt's KV
blocks where they are (held: no row copied) and a hit starts the new sequence's block table from them; a bounded
pool short of blocks evicts entries first. Everything else an entry holds (recurrent states, QSA's indexer keys,
the MTP head's cache; every row without a pool) lives in host memory, copied back on a hit. The budget counts
both. Only the engine thread calls `restore`, `insert` and `reclaim`; `stats()` may be read from any thread.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, is_dataclass

import numpy as np
import torch

from moestream.layers.kv import BlockPool
from moestream.models.base import SequenceState


@dataclass
class _Entry:
    state: SequenceState  # on the host, but for its KV blocks
    capacities: list[int | None]  # per layer: KV buffer rows when snapshotted (None: not an attention cache)
    nbytes: int  # host bytes (its blocks are counted once however many entries hold them)
    blocks: list[int]  # the pool blocks it holds


def block_keys(ids: list[int], chunk: int, blocks: int) -> list[bytes]:
    """The chain hashes of the first `blocks` full blocks of `ids`."""
    keys, prev = [], b""
    for i in range(blocks):
        block = np.asarray(ids[i * chunk: (i + 1) * chunk], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        keys.append(prev)
    return keys


def _tensors(obj, fn):
    """Replace every tensor held by the state `obj` (its attributes, nested states and lists of states) by
    `fn(tensor)`, in place; returns the total bytes."""
    total = 0
    items = enumerate(obj) if isinstance(obj, list) else list(vars(obj).items())
    for name, value in items:
        if isinstance(value, torch.Tensor):
            moved = fn(value)
            total += moved.numel() * moved.element_size()
            if isinstance(obj, list):
                obj[name] = moved
            else:
                setattr(obj, name, moved)
        elif _is_state(value) or (isinstance(value, list) and value and _is_state(value[0])):
            total += _tensors(value, fn)  # nested states and their snapshots; not token lists
    return total


def _is_state(value) -> bool:
    return hasattr(value, "snapshot") or is_dataclass(value)


def host_snapshot(state: SequenceState, shared: bool = False) -> tuple[SequenceState, int]:
    """A snapshot of `state` in host memory (it must not take GPU memory from the expert pool), and its host bytes;
    `shared`: its KV rows kept in their pool's blocks instead (SequenceState.snapshot)."""
    snap = state.snapshot(shared)
    return snap, _tensors(snap, lambda t: t.cpu())


def _capacity(layer_state) -> int | None:
    return layer_state.capacity if hasattr(layer_state, "reserve") else None


class PrefixCache:
    def __init__(self, budget_bytes: int, chunk: int, pool: BlockPool | None = None):
        """`pool`: the decoder's KV pool, whose blocks entries keep (None: every row copied to the host)."""
        self.budget_bytes, self.chunk, self.pool = budget_bytes, chunk, pool
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self.host_bytes = 0
        self.held: Counter[int] = Counter()  # KV block -> entries holding it
        self.counters = dict(lookups=0, hits=0, misses=0, cached_tokens=0, inserts=0, evictions=0, too_big=0)
        if pool is not None:
            pool.reclaim = self.reclaim

    def restore(self, ids: list[int], state: SequenceState) -> int:
        """Load into the new sequence's `state` the deepest cached boundary b < len(ids) that is a prefix of `ids`;
        returns b (0: nothing cached). The cached snapshot stays untouched."""
        keys = block_keys(ids, self.chunk, (len(ids) - 1) // self.chunk)
        with self.lock:
            self.counters["lookups"] += 1
            for depth in range(len(keys), 0, -1):
                entry = self.entries.get(keys[depth - 1])
                boundary = depth * self.chunk
                if entry is not None and entry.state.tokens == ids[:boundary]:
                    self.entries.move_to_end(keys[depth - 1])
                    self.counters["hits"] += 1
                    self.counters["cached_tokens"] += boundary
                    break
            else:
                self.counters["misses"] += 1
                return 0
        state.load(entry.state)
        for layer_state, capacity in zip(state.layers, entry.capacities):
            if capacity is not None:
                layer_state.reserve(capacity)
        return boundary

    def insert(self, state: SequenceState) -> None:
        """Called by prefill at each boundary: keep a snapshot of `state` unless one is cached already."""
        boundary = state.length
        if boundary == 0 or boundary % self.chunk:
            return
        if state.draft is not None and state.draft.length != boundary:  # the MTP head waits on the next token
            return
        key = block_keys(state.tokens, self.chunk, boundary // self.chunk)[-1]
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return
        snap, nbytes = host_snapshot(state, state.keeps_rows_in(self.pool))
        entry = _Entry(snap, [_capacity(s) for s in state.layers], nbytes, snap.snapshot_blocks())
        while self.entries and self._bytes(entry) > self.budget_bytes:
            self._evict()
        if self._bytes(entry) > self.budget_bytes:
            if entry.blocks:
                self.pool.give(entry.blocks)
            with self.lock:
                self.counters["too_big"] += 1
            return
        with self.lock:
            self.entries[key] = entry
            self.host_bytes += nbytes
            self.held.update(entry.blocks)
            self.counters["inserts"] += 1

    @property
    def bytes(self) -> int:
        """Host bytes and KV block bytes the entries hold."""
        return self.host_bytes + (len(self.held) * self.pool.block_bytes if self.held else 0)

    def _bytes(self, entry: _Entry) -> int:
        """`bytes` with `entry` in."""
        fresh = len(set(entry.blocks) - self.held.keys())
        return self.bytes + entry.nbytes + (fresh * self.pool.block_bytes if fresh else 0)

    def reclaim(self, blocks: int) -> None:
        """The KV pool needs `blocks` more free blocks: the least recently used entries go until it has them (those
        that sequences still hold too free nothing)."""
        need = len(self.pool.free) + blocks
        while self.entries and len(self.pool.free) < need:
            self._evict()

    def _evict(self) -> None:
        with self.lock:
            _, old = self.entries.popitem(last=False)
            self.host_bytes -= old.nbytes
            self.held.subtract(old.blocks)
            self.held = +self.held  # blocks no entry holds leave
            self.counters["evictions"] += 1
        if old.blocks:
            self.pool.give(old.blocks)

    def clear(self) -> None:
        while self.entries:
            self._evict()

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters, entries=len(self.entries), bytes=self.bytes, budget_bytes=self.budget_bytes,
                        chunk=self.chunk, kv_blocks=len(self.held))
