"""Ring misses computed on the host CPU (`--cpu-experts`): records the host tier holds are multiplied where they
lie while the GPU streams and computes the rest. A ring step yields a `HostExperts` part first (the kernels start
the CPU on it) and last a `RemoteExperts` part that joins its outputs into the step's before the combine.

The cost model is measured once, when the provider is made: the copy of one record to the device (what the ring
pays per miss) and the CPU's time per expert, t(rows) = fixed + per_row * rows (the host kernel's own `measure`);
what the CPU then takes on real steps, beside the GPU's work, scales it (a moving average). A ring step gives the
CPU its least-used misses for as long as the CPU's share ends before the copies of the rest would. "all" gives it
every eligible miss (tests; timing the CPU path alone). The kernel comes in from the engine (`kernel`: a module
with `unavailable(layout)` and `measure(layout, threads)`, kernels/host_experts.py), as experts/ does not import
kernels/.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import torch

from moestream.experts.grouping import Grouping, HostExperts, RemoteExperts
from moestream.experts.residency import Residency

CALIBRATION_RECORDS = 4


@dataclass(frozen=True)
class HostRates:
    copy_s: float  # one record to the device
    fixed_s: float  # the CPU's time per expert, plus per_row_s per routing entry
    per_row_s: float

    def cpu_s(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows


def _packed(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` moved back to back from 0, in their order."""
    out, at = [], 0
    for a, b in spans:
        out.append((at, at + b - a))
        at += b - a
    return out


class HostCompute:
    def __init__(self, residency: Residency, mode: str, kernel=None):
        self.res, self.mode, self.kernel = residency, mode, kernel
        self.layout = residency.layouts[residency.miss]
        self.rates: HostRates | None = None
        self.slowdown = 1.0  # the CPU's measured time over the model's, on real steps (a moving average)
        self.threads = max(1, len(os.sched_getaffinity(0)) - 2)  # the caller's thread and the copies' keep a core
        self.reason = self._unavailable()
        if self.reason is None and mode == "auto":
            self.rates = HostRates(self._copy_seconds(), *kernel.measure(self.layout, self.threads))
        elif self.reason is not None and mode != "off":
            warnings.warn(f"--cpu-experts {mode} is off: {self.reason}", stacklevel=2)

    def _unavailable(self) -> str | None:
        if self.mode == "off":
            return "off"
        host = self.res.host
        if host is None:
            return "no host tier"
        if host.capacity < self.res.geometry.num_records:  # a record the CPU reads must not be evicted meanwhile
            return "the host tier does not hold every record"
        if self.kernel is None:
            return "no host kernel"
        return self.kernel.unavailable(self.layout)

    def describe(self) -> dict:
        """For the stats: the mode, why it is off where it cannot run, the rates the cost model measured."""
        rates = None if self.rates is None else {k: round(v * 1e6, 1) for k, v in vars(self.rates).items()}
        return {"mode": self.mode, "off_because": None if self.mode == "off" else self.reason, "rates_us": rates,
                "slowdown": round(self.slowdown, 2)}

    def choose(self, layer: int, g: Grouping, hits: list[int | None], early: set[int]) -> list[int]:
        """The step's experts (indices into `g`) the CPU computes: misses in the host tier whose record was not
        fetched early (`early`: record ids on their way to the ring already), least used first."""
        if self.reason is not None:
            return []
        host, geometry, precision = self.res.host, self.res.geometry, self.res.miss
        misses = [j for j, slot in enumerate(hits) if slot is None]
        eligible = sorted((j for j in misses if (precision, geometry.rid(layer, g.experts[j])) in host.slot_of
                           and geometry.rid(layer, g.experts[j]) not in early), key=lambda j: g.counts[j])
        if self.mode == "all":
            return sorted(eligible)
        rates, chosen, cpu_s = self.rates, [], 0.0
        for j in eligible:
            after = cpu_s + rates.cpu_s(g.counts[j]) * self.slowdown
            if after > (len(misses) - len(chosen) - 1) * rates.copy_s:
                break
            chosen.append(j)
            cpu_s = after
        return sorted(chosen)

    def start(self, layer: int, g: Grouping, index: list[int], x: torch.Tensor, top_k: int
              ) -> tuple[HostExperts, RemoteExperts]:
        """The CPU's part for experts `index` of `g` (activations x [T, H]), and the part joining its outputs. Their
        rows go to the host asynchronously: the GPU's batches are enqueued meanwhile."""
        host, geometry = self.res.host, self.res.geometry
        slots = [host.slot_of[self.res.miss, geometry.rid(layer, g.experts[j])] for j in index]
        spans = [(g.offsets[j], g.offsets[j + 1]) for j in index]
        entries = torch.cat([g.order[a:b] for a, b in spans])
        rows = x.index_select(0, entries // top_k)
        cuda = rows.is_cuda
        rows_host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=cuda).copy_(rows, non_blocking=cuda)
        landed = self.res.device.event()
        landed.record()
        part = HostExperts([host.buffer.data_ptr() + s * host.stride for s in slots], _packed(spans), rows_host,
                           landed, [host.last_job[s] for s in slots], self.layout, self.threads)
        predicted = sum(self.rates.cpu_s(b - a) for a, b in spans) if self.rates else 0.0
        stats = self.res.stats.at(layer, self.res.miss)
        stats.cpu_records += len(index)
        stats.cpu_entries += entries.shape[0]

        def join(out: torch.Tensor) -> None:
            y = part.future.result()
            if predicted:  # the CPU's rate beside the GPU's work, not alone: the model follows what it sees
                self.slowdown = 0.8 * self.slowdown + 0.2 * part.seconds / predicted
            out.index_copy_(0, entries, y.to(out.device, non_blocking=cuda))

        return part, RemoteExperts(join)

    def _copy_seconds(self) -> float:
        """The copy of a record to the device, the best of three runs over a few."""
        device = self.res.device.device
        source = self.res.host.buffer[:CALIBRATION_RECORDS]
        target = torch.empty_like(source, device=device)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            self.res.fetcher.throttle(source.numel())  # a capped link (benchmarks) as the ring sees it
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:]) / CALIBRATION_RECORDS
