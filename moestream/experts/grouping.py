"""Grouping a step's (row, k) routing entries by expert: the CSR that both the residency decisions and
the expert kernels read. Stable, so each expert's rows keep their order whatever is resident. And the two kinds
of parts the provider hands the expert kernels: batches of records in slots, or a layer's records by address."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestream.experts.format import RecordLayout


@dataclass(frozen=True)
class Grouping:
    experts: list[int]  # distinct experts, ascending
    counts: list[int]  # routing entries per expert
    offsets: list[int]  # len(experts) + 1 CSR offsets into `order`
    order: torch.Tensor  # [T * K] flat (row * K + k) indices, grouped by expert (device of the ids)


def expert_order(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The stable sort of routing entries `ids` (<= num_experts) by expert, on keys of 8 or 16 bits where they fit:
    a radix sort passes over every bit of its keys (eight passes for int64 ids). The same permutation."""
    key = torch.uint8 if num_experts <= 255 else torch.int16 if num_experts <= 32767 else ids.dtype
    return torch.argsort(ids.to(key), stable=True)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None) -> Grouping:
    """topk_ids [T, K] -> grouping. One small device-to-host copy: the per-expert counts. `keep` [num_experts]
    bool: only those experts' entries (a rank's share, experts/sharding.py); the others sort last, unreferenced."""
    flat = topk_ids.reshape(-1)
    if keep is not None:
        flat = torch.where(keep[flat], flat, num_experts)
    order = expert_order(flat, num_experts)
    per_expert = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    experts = [e for e, c in enumerate(per_expert) if c]
    counts = [per_expert[e] for e in experts]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return Grouping(experts, counts, offsets, order)


@dataclass(frozen=True)
class ExpertBatch:
    """Experts ready to compute: their records sit in `buffer[slots[j]]`; expert j owns the flat routing
    entries `order[spans[j][0]:spans[j][1]]` (`order` is the whole step's grouping, so a batch costs no
    gather). The consumer may read the buffer as soon as it gets the batch (the provider has made the compute
    stream wait for the copies)."""

    buffer: torch.Tensor  # [num_slots, stride] uint8
    layout: RecordLayout
    experts: list[int]
    slots: list[int]
    spans: list[tuple[int, int]]
    order: torch.Tensor


def batch_of(grouping: Grouping, index: list[int], buffer: torch.Tensor, layout: RecordLayout,
             slots: list[int]) -> ExpertBatch:
    """The sub-batch of `grouping` made of experts at positions `index`, with their slots."""
    spans = [(grouping.offsets[j], grouping.offsets[j + 1]) for j in index]
    return ExpertBatch(buffer, layout, [grouping.experts[j] for j in index], slots, spans, grouping.order)


@dataclass(frozen=True)
class HostStaging:
    """Where a batched addressed step copies its host-tier records first (kernels/staging.py): the pinned host
    tier's byte range, device `slots` [capacity, stride] (the ring's, idle in such a step), the bytes of a host
    record, and device scratch for the step's table [num_experts] and the slots' sources [capacity]."""

    host_base: int
    host_end: int
    slots: torch.Tensor
    record_bytes: int
    table: torch.Tensor
    sources: torch.Tensor


@dataclass(frozen=True)
class AddressedExperts:
    """Routing entry e reads the record at `table[ids[e]]` (a layer's addresses by expert id; ids [T * top_k]);
    mixed mode, `low_bit`: (the miss layout, the layer's record bits by expert id). With `staging` (several rows),
    the step's host-tier records are copied to device slots once each before the entries read them."""

    table: torch.Tensor
    ids: torch.Tensor
    layout: RecordLayout
    low_bit: tuple | None
    staging: HostStaging | None = None


@dataclass(frozen=True)
class PlacedExperts:
    """A prefill step with every record of its layer in the GPU pool at `table[e]` (the layer's addresses by expert
    id): grouped and tiled on the device, so the host never waits for the routing. ids [T * top_k]; `uses` [E]
    int32 (device) gains 1 for each expert the step uses, counted by the residency later; `entries` [1] (device): a
    padded prompt's own entries, the first ones, the only ones computed."""

    table: torch.Tensor
    ids: torch.Tensor
    layout: RecordLayout
    uses: torch.Tensor
    entries: torch.Tensor | None = None


@dataclass(frozen=True)
class RemoteExperts:
    """The entries other ranks computed, summed into the step's outputs by `join(out)` (experts/sharding.py)."""

    join: Callable[[torch.Tensor], None]
