"""The decode fetch path (a step of few rows, records not addressable in place): hits compute at once; misses
get pool slots (the pool's eviction, never a slot this step uses) and fetches (at the miss precision in mixed mode),
and compute after their copies; then layer L+1's router applied to the current hidden state predicts L+1's
experts, and their fetches start after L's misses (one-layer lookahead)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moestream.experts.grouping import ExpertBatch, Grouping, batch_of
from moestream.experts.residency import Residency


class DecodePath:
    def __init__(self, residency: Residency, top_k: int, lookahead: bool, keep: list[bool] | None = None):
        """`keep`: by expert id, the experts this rank holds (experts/sharding.py), the only ones it prefetches."""
        self.res, self.top_k, self.lookahead, self.keep = residency, top_k, lookahead, keep
        self.routers: dict[int, torch.Tensor] = {}  # layer slot -> router weight, for lookahead

    def claim(self, layer: int, experts: list[int]) -> tuple[list[int], list, bool]:
        """Layer `layer`'s distinct `experts`, counted as a decode step's lookups, each in a pool slot pinned for
        this step: a hit where it is, a miss in a slot the pool frees for it, fetched at the miss precision. Returns
        the slots, the fetches to wait for (None: none) and whether any record missed."""
        res, pool, geometry = self.res, self.res.pool, self.res.geometry
        res.stats.at(layer, res.base).decode_steps += 1
        rids = [geometry.rid(layer, e) for e in experts]
        slots = res.lookups(layer, rids)
        futures = [pool.pending[s] if s is not None else None for s in slots]
        misses = [i for i, s in enumerate(slots) if s is None]
        items = []
        for i in misses:  # into distinct slots, pinned for this step (the pool's eviction skips them)
            slots[i] = pool.allocate(rids[i])
            pool.pin(slots[i])
            items.append((rids[i], slots[i]))
        for i, future in zip(misses, res.fetch(layer, items, res.miss) if items else []):
            futures[i] = future
        return slots, futures, bool(items)

    def batches(self, layer: int, g: Grouping, x: torch.Tensor) -> Iterator[ExpertBatch]:
        res, pool = self.res, self.res.pool
        slots, futures, _ = self.claim(layer, g.experts)
        jobs = list(zip(range(len(slots)), slots, futures))
        self.prefetch_next(layer, x)
        hits = [job for job in jobs if job[2] is None or job[2].done()]
        later = [job for job in jobs if job not in hits]
        used = []
        for part in (hits, later):  # residents compute at once, the misses after their copies
            for precision, group in res.by_precision(part):
                res.wait(layer, [s for _, s, _ in group], [w for _, _, w in group])
                used += [s for _, s, _ in group]
                yield batch_of(g, [j for j, _, _ in group], pool.buffer, res.layouts[precision],
                               [s for _, s, _ in group])
        res.done(used)

    def prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        """Layer L+1's router applied to layer L's input x [T, H] predicts L+1's experts: their fetches start now."""
        if (predicted := self.predict(layer, x)) is not None:
            self.prefetch(layer, predicted.unique().tolist())

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layer L+1's experts as its router picks them for layer L's input x [T, H] (on the device), or None."""
        router = self.routers.get(layer + 1)
        if router is None or not self.lookahead:
            return None
        return torch.topk(x @ router.T, self.top_k, dim=-1).indices.reshape(-1)

    def prefetch(self, layer: int, predicted: list[int]) -> None:
        """Start fetching layer L+1's `predicted` experts (distinct, in order) into free pool slots."""
        if not predicted:  # the last layer, or no lookahead
            return
        res, pool = self.res, self.res.pool
        c = res.stats.at(layer + 1, res.base)
        for e in predicted if self.keep is None else [e for e in predicted if self.keep[e]]:
            rid = res.geometry.rid(layer + 1, e)
            if pool.lookup(rid) is not None:
                continue
            slot = pool.allocate(rid)
            if slot is None:
                break
            pool.prefetched.add(rid)
            res.fetch(layer + 1, [(rid, slot)], res.fill_precision(rid))
            c.prefetch_issued += 1
