"""Ring misses computed on the host CPU (`--cpu-experts`): records the host tier holds are multiplied where they
lie (kernels/host_experts.py) while the GPU streams and computes the rest; their outputs are joined into the
step's before the combine (a `RemoteExperts` part, the last of the step).

The cost model is measured once, when the provider is made: the copy of one record to the device (what the ring
pays per miss) and the CPU's time per expert, t(rows) = fixed + per_row * rows, from 1- and 16-row runs over a
few records. A ring step then gives the CPU its least-used misses for as long as the CPU's share ends before the
copies of the rest would. "all" gives it every eligible miss (tests; timing the CPU path alone).
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moestream.experts.grouping import Grouping, RemoteExperts
from moestream.experts.residency import Residency
from moestream.kernels import host_experts

CALIBRATION_RECORDS = 4


@dataclass(frozen=True)
class HostRates:
    copy_s: float  # one record to the device
    fixed_s: float  # the CPU's time per expert, plus per_row_s per routing entry
    per_row_s: float

    def cpu_s(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows


class HostCompute:
    def __init__(self, residency: Residency, mode: str):
        self.res, self.mode = residency, mode
        self.layout = residency.layouts[residency.miss]
        self.reason = self._unavailable()
        self.rates: HostRates | None = None
        self.threads = max(1, len(os.sched_getaffinity(0)) - 2)  # the caller's thread and the copies' keep a core
        if self.reason is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="moestream-cpu-experts")
            self.rates = self._calibrate() if mode == "auto" else None
        elif mode != "off":
            warnings.warn(f"--cpu-experts {mode} is off: {self.reason}", stacklevel=2)

    def describe(self) -> dict:
        """For the stats: the mode, why it is off where it cannot run, the rates the cost model measured."""
        rates = None if self.rates is None else {k: round(v * 1e6, 1) for k, v in vars(self.rates).items()}
        return {"mode": self.mode, "off_because": None if self.mode == "off" else self.reason, "rates_us": rates}

    def _unavailable(self) -> str | None:
        if self.mode == "off":
            return "off"
        host = self.res.host
        if host is None:
            return "no host tier"
        if host.capacity < self.res.geometry.num_records:  # a record the CPU reads must not be evicted meanwhile
            return "the host tier does not hold every record"
        return host_experts.unavailable(self.layout)

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
            after = cpu_s + rates.cpu_s(g.counts[j])
            if after > (len(misses) - len(chosen) - 1) * rates.copy_s:
                break
            chosen.append(j)
            cpu_s = after
        return sorted(chosen)

    def start(self, layer: int, g: Grouping, index: list[int], x: torch.Tensor, top_k: int) -> RemoteExperts:
        """Starts the CPU on experts `index` of `g` for activations x [T, H]; the part joins their outputs."""
        host, geometry = self.res.host, self.res.geometry
        slots = [host.slot_of[self.res.miss, geometry.rid(layer, g.experts[j])] for j in index]
        waits = [host.last_job[s] for s in slots]  # a fill still under way
        records = [host.buffer.data_ptr() + s * host.stride for s in slots]
        spans = [(g.offsets[j], g.offsets[j + 1]) for j in index]
        order = g.order.cpu()
        entries = torch.cat([g.order[a:b] for a, b in spans])
        x_host = x.to("cpu")

        def job() -> torch.Tensor:
            for w in waits:
                if w is not None:
                    w.result()
            return host_experts.expert_group(x_host, records, self.layout, spans, order, top_k, self.threads)

        future: Future = self.worker.submit(job)
        stats = self.res.stats.at(layer, self.res.miss)
        stats.cpu_records += len(index)
        stats.cpu_entries += sum(b - a for a, b in spans)

        def join(out: torch.Tensor) -> None:
            out.index_copy_(0, entries, future.result().to(out.device))

        return RemoteExperts(join)

    def _calibrate(self) -> HostRates:
        """The copy of a record to the device and the CPU's time per expert, each the best of three runs."""
        layout, device = self.layout, self.res.device.device
        source = self.res.host.buffer[:CALIBRATION_RECORDS]
        records = host_experts.random_records(layout, CALIBRATION_RECORDS)
        target = torch.empty_like(source, device=device)

        def copy() -> None:
            target.copy_(source, non_blocking=True)
            self.res.fetcher.throttle(source.numel())  # a capped link (benchmarks) as the ring sees it
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def cpu(rows: int):
            x = torch.randn(rows * CALIBRATION_RECORDS, layout.hidden_size, dtype=torch.bfloat16)
            spans = [(j * rows, (j + 1) * rows) for j in range(CALIBRATION_RECORDS)]
            ptrs = [r.data_ptr() for r in records]
            return lambda: host_experts.expert_group(x, ptrs, layout, spans, torch.arange(x.shape[0]), 1,
                                                     self.threads)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times) / CALIBRATION_RECORDS

        one, many = best(cpu(1)), best(cpu(16))
        per_row = max(0.0, (many - one) / 15)
        return HostRates(best(copy), max(0.0, one - per_row), per_row)

    def close(self) -> None:
        if self.reason is None:
            self.worker.shutdown(wait=True)
