"""The one seam between the MoE layers and the expert subsystem: `parts(layer, ids, x, step)` says where the
records of a layer step's experts are, as parts the expert kernels compute (kernels/ops.py `expert_part`):

- `AddressedExperts`: every record at a device address, read in place with no host decision (a decode step
  captured as a CUDA graph; addresses.py);
- `ExpertBatch`es of records in pool or ring slots, whose copies the compute stream already waits for: the
  decode fetch path for few rows (decode.py), the prefill ring for many (ring.py, ring_plan.py);
- with `step.scratch` (warming the kernels at load), every expert read from one scratch record, touching
  neither residency nor counters.

The provider decides only where records are, never how they are computed, so results do not depend on it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moestream.config import ExpertConfig
from moestream.experts.addresses import AddressTable
from moestream.experts.decode import DecodePath
from moestream.experts.grouping import AddressedExperts, ExpertBatch, PlacedExperts, batch_of, group_by_expert
from moestream.experts.pieces import PieceTable
from moestream.experts.residency import Residency
from moestream.experts.ring import RingAhead, RingPath
from moestream.experts.store import Store
from moestream.stats.trace import RoutingTrace

if TYPE_CHECKING:
    from moestream.experts.sharding import Shard


@dataclass(frozen=True)
class Padding:
    """A prompt's forward padded to a fixed row count (engine/prefill.py): its first `rows` rows are its own (a host
    int, which a replayed graph never reads), their routing entries `entries` [1] int64 on the device. The other
    rows' entries are computed by no expert; their outputs stay zero."""

    rows: int
    entries: torch.Tensor


@dataclass
class ExpertStep:
    """The expert subsystem's view of one forward step, made by the engine and passed down to every MoE layer.
    `addresses` [layers, experts]: read records in place (and write the routers' ids to `routed` [layers, rows *
    top_k], counted after the step); `pieces`: read them where the host put them in its turn after each layer's
    routing, `cut(layer, x)` (x: the layer's input; a decode step captured in pieces, experts/pieces.py); `ahead`:
    the early ring fetches one layer makes for the next; `padding`: a padded prompt's (only its own rows' entries
    are computed and traced)."""

    addresses: torch.Tensor | None = None
    routed: torch.Tensor | None = None
    ahead: RingAhead | None = None
    scratch: bool = False
    padding: Padding | None = None
    pieces: PieceTable | None = None
    cut: Callable[[int, torch.Tensor], None] | None = None


class ExpertProvider:
    def __init__(self, store: Store, cfg: ExpertConfig, device: torch.device, top_k: int, reserved: int = 0,
                 shard: Shard | None = None):
        """`reserved`: GPU bytes other parts take later, which a pool sized from free memory leaves them. `shard`
        (experts/sharding.py): this rank's share of the experts, the only ones it is asked for and preloads."""
        self.cfg, self.top_k, self.shard = cfg, top_k, shard
        self.residency = res = Residency(store, cfg, device, top_k, reserved)
        self.geometry, self.layout, self.pool, self.stats = res.geometry, res.layouts[res.base], res.pool, res.stats
        self.keep = shard.keep(self.geometry.num_experts, device) if shard else None
        keep = None if shard is None else self.keep.tolist()
        self.decode = DecodePath(res, top_k, cfg.lookahead, keep)
        self.ring = RingPath(res, cfg.ring_group, cfg.ring_lookahead, keep)
        self.addresses = AddressTable(res, keep)
        self._scratch, self._held, self._pieces = None, None, None

    def attach(self, routers: dict[int, torch.Tensor]) -> None:
        """The routers by layer slot, for the decode path's lookahead."""
        self.decode.routers = {slot: w.to(self.residency.device.device) for slot, w in routers.items()}

    def parts(self, layer: int, ids: torch.Tensor, x: torch.Tensor, step: ExpertStep) -> Iterator:
        """The parts that compute layer `layer`'s routing entries `ids` [T, top_k] for activations x [T, H]."""
        if step.scratch:
            yield from self._scratch_parts(ids)
            return
        if step.pieces is not None:
            yield step.pieces.part(layer, ids)
            return
        if step.addresses is not None:
            staging = self.addresses.staging() if ids.shape[0] > 1 else None  # one row's ids are distinct
            yield AddressedExperts(step.addresses[layer], ids.reshape(-1), self.layout, self.addresses.low_bit(layer),
                                   staging)
            return
        res, rows, pad = self.residency, ids.shape[0], step.padding
        if rows >= self.cfg.prefill_min_rows and (placed := self._placed(layer)) is not None:
            yield PlacedExperts(placed, ids.reshape(-1), self.layout, res.placed_uses(layer),
                                pad.entries if pad is not None else None)
            return
        if pad is not None:  # the host groups the prompt's own rows alone; the step's size still picks its path
            ids, x = ids[: pad.rows], x[: pad.rows]
        res.flush()  # count earlier addressed steps before this step changes residency
        if res.trace is not None:
            res.trace.step(layer, ids.tolist(), rows)
        g = group_by_expert(ids, self.geometry.num_experts, self.keep)
        res.pool.new_step()
        ahead, step.ahead = step.ahead, None  # good for the next layer's ring step only
        if rows >= self.cfg.prefill_min_rows or len(g.experts) > res.pool.num_slots:
            step.ahead = yield from self.ring.batches(layer, g, ahead)
        else:
            yield from self.decode.batches(layer, g, x)

    def _placed(self, layer: int) -> torch.Tensor | None:
        """The layer's addresses when a prefill step may group on the device (PlacedExperts): the whole
        model in the pool, and no rank share, trace or per-layer profile, which need the host's grouping."""
        res = self.residency
        if self.shard is not None or res.trace is not None or res.profiler.enabled:
            return None
        return self.addresses.placed(layer)

    def placed_prefill(self, rows: int) -> bool:
        """Whether a prefill step of `rows` rows groups on the device in every layer now (PlacedExperts): no host
        decision, so such a forward can be captured."""
        return rows >= self.cfg.prefill_min_rows and self._placed(0) is not None

    def note_placed(self, layers: list[int]) -> None:
        """A replayed graph ran placed prefill steps of these layers (their uses counted on the device)."""
        for layer in layers:
            self.residency.note_placed(layer)

    def flush(self) -> None:
        """Count the steps noted so far now (before a replay aside adds to the device's placed counts)."""
        self.residency.flush()

    def _scratch_parts(self, ids: torch.Tensor) -> Iterator[ExpertBatch]:
        """The step's experts, grouped as a real step groups them, each computed from one zeroed record at each
        precision: every kernel variant the step's shape picks is compiled and run once, with no fetch and no
        count."""
        res = self.residency
        if self._scratch is None:
            self._scratch = torch.zeros(1, res.pool.stride, dtype=torch.uint8, device=res.device.device)
        g = group_by_expert(ids, self.geometry.num_experts, self.keep)
        for layout in res.layouts.values():
            yield batch_of(g, list(range(len(g.experts))), self._scratch, layout, [0] * len(g.experts))

    def preload(self, on_progress=None) -> str | None:
        return self.addresses.preload(on_progress)

    def address_table(self) -> torch.Tensor | None:
        return self.addresses.table()

    def piece_table(self, rows: int) -> PieceTable | None:
        """Where a decode step of `rows` rows in pieces reads its records (CUDA, one rank; None when a layer's
        records might outnumber the pool's slots, which the ring then streams), made once."""
        if not self.residency.device.cuda or self.shard is not None or rows * self.top_k > self.pool.num_slots:
            return None
        if self._pieces is None:
            self._pieces = PieceTable(self.decode)
        return self._pieces

    def note_addressed(self, routed: torch.Tensor) -> None:
        self.residency.note_addressed(routed)

    def trace(self, sink) -> None:
        """Record every counted step's routing to `sink` (a text file or a list; stats/trace.py), or stop with None.
        Steps read by address are written when they are counted, so before the sink is read, stop."""
        res = self.residency
        res.flush()
        g = self.geometry
        res.trace = None if sink is None else RoutingTrace(sink, g.num_layers, g.num_experts, self.top_k,
                                                           self.cfg.prefill_min_rows)

    @contextlib.contextmanager
    def uncounted(self):
        """Steps in the block leave the counters as they were (warming up)."""
        self.hold_counters()
        try:
            yield
        finally:
            self.restore_counters()

    def hold_counters(self) -> None:
        self.residency.flush()
        self._held = copy.deepcopy((self.stats.layers, self.stats.expert_uses))

    def restore_counters(self) -> None:
        self.residency.flush()
        self.stats.layers, self.stats.expert_uses = self._held

    # -- reporting ------------------------------------------------------------------------------------
    def totals(self) -> dict:
        """The counters' totals per precision, with every addressed step counted so far."""
        self.residency.flush()
        return self.stats.totals()

    def snapshot(self) -> dict:
        """The counters, with which experts of each layer are resident in the GPU pool right now."""
        res = self.residency
        res.flush()
        self.stats.timings.extend(res.profiler.resolve(res.device.device) if res.profiler.enabled else [])
        self.stats.resident = res.resident()
        snap = self.stats.snapshot()
        snap["pool"] = {"slots": res.pool.num_slots, "resident": res.pool.resident, "ring_slots": res.pool.ring_slots,
                        "stride": res.pool.stride, "precision": res.base, "miss_precision": res.miss,
                        "host_slots": res.host.capacity if res.host else 0}
        return snap

    @property
    def io_note(self) -> str | None:
        return self.residency.io_note

    def close(self) -> None:
        self.residency.close()
