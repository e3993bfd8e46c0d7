"""Experts spread over several ranks (GPUs, or CPU processes in tests) through torch.distributed: expert e of every
layer belongs to rank e % world, which keeps it in its own pool and host tier and fetches it over its own link.

Rank 0 runs the model. At each MoE layer its provider (`ShardedProvider`) broadcasts the rows and their routing,
every rank computes the entries of its own experts (engine/ranks.py serves the others), and a sum onto rank 0
gathers them: an entry is non-zero on one rank alone and v + 0 is exact, so each entry keeps the bits one rank
would give it, and the layer combines them in k order as always. The other ranks answer calls (counters, stats)
on a gloo group, so control never waits behind the data's NCCL streams.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moestream.experts.grouping import RemoteExperts
from moestream.experts.provider import ExpertProvider, ExpertStep

STOP, STEP, CALL = 0, 1, 2  # a header's operation


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def keep(self, num_experts: int, device: torch.device) -> torch.Tensor:
        """[num_experts] bool: this rank's experts."""
        return torch.arange(num_experts, device=device) % self.world == self.rank


def join(y: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> None:
    """Sum every rank's entries onto rank 0's `y` [T * top_k, H]: each rank zeroes the entries of experts it does not
    hold first (`keep` [num_experts] bool, by expert id; ids [T, top_k])."""
    y.masked_fill_(~keep[ids.reshape(-1)][:, None], 0)
    dist.reduce(y, 0, op=dist.ReduceOp.SUM)


class ShardedProvider(ExpertProvider):
    """Rank 0's provider: its own experts as any provider's, the other ranks' through collectives. Graphs are not
    captured across ranks yet (`address_table` is None): decode routes every layer through the host."""

    def __init__(self, *args, shard: Shard, control, **kw):
        super().__init__(*args, shard=shard, **kw)
        self.control = control

    def parts(self, layer: int, ids: torch.Tensor, x: torch.Tensor, step: ExpertStep):
        ids = ids.to(torch.int64).contiguous()
        self._header(STEP, layer, ids.shape[0], int(step.scratch), step.padding.rows if step.padding else 0)
        dist.broadcast(x.contiguous(), 0)
        dist.broadcast(ids, 0)
        yield from super().parts(layer, ids, x, step)
        yield RemoteExperts(lambda y: join(y, ids, self.keep))

    def address_table(self) -> None:
        return None

    def call(self, name: str, *args) -> list:
        """`provider.name(*args)` on every other rank; their results in rank order."""
        self._header(CALL)
        dist.broadcast_object_list([(name, args)], 0, group=self.control)
        results = [None] * self.shard.world
        dist.gather_object(None, results, dst=0, group=self.control)
        return results[1:]

    def attach(self, routers: dict[int, torch.Tensor]) -> None:
        super().attach(routers)
        self.call("attach", {slot: w.cpu() for slot, w in routers.items()})

    def preload(self, on_progress=None) -> str | None:
        where = super().preload(on_progress)
        return where if all(w == where for w in self.call("preload")) else None

    def totals(self) -> dict:
        return self.snapshot()["totals"]

    def snapshot(self) -> dict:
        """The counters of every rank added up (each counts its own experts), and each rank's pool in `ranks`."""
        snaps = [super().snapshot(), *self.call("snapshot")]
        merged = snaps[0] | {k: _sum([s[k] for s in snaps]) for k in ("layers", "totals")}
        merged["experts"] = [{"uses": _sum([s["experts"][i]["uses"] for s in snaps]),
                              "resident": sorted(e for s in snaps for e in s["experts"][i]["resident"])}
                             for i in range(len(snaps[0]["experts"]))]
        merged["ranks"] = [{"rank": r, "pool": s["pool"], "totals": s["totals"]} for r, s in enumerate(snaps)]
        return merged

    @contextlib.contextmanager
    def uncounted(self):
        self.call("hold_counters")
        try:
            with super().uncounted():
                yield
        finally:
            self.call("restore_counters")

    def _header(self, op: int, layer: int = 0, rows: int = 0, scratch: int = 0, own: int = 0) -> None:
        header(self.control, op, layer, rows, scratch, own)


HEADER = 5  # ints a header broadcasts


def header(control, op: int, layer: int = 0, rows: int = 0, scratch: int = 0, own: int = 0) -> None:
    """Rank 0 tells the others what comes next (STOP, a layer STEP of `rows` rows, of which the first `own` are a
    padded prompt's own (0: not padded), a CALL)."""
    dist.broadcast(torch.tensor([op, layer, rows, scratch, own]), 0, group=control)


def _sum(values: list):
    """Numbers, lists and dicts of them added leaf by leaf (missing dict keys count as zero)."""
    first = values[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list):
        return [_sum(list(column)) for column in zip(*values)]
    return sum(values)
