"""Optional per-layer prefill timing with CUDA events: copy-stream busy time, expert compute time and
wall time, resolved only when the stats are read (no synchronisation while running); and the host's time
in the layer's ring path, which bounds the wall when the GPU outruns the host. A layer's copies include those
started before it (the ring's early fetches), so its copy time can exceed its wall."""

from __future__ import annotations

import time

import torch


class Profiler:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.layers: list[dict] = []
        self.current: dict | None = None
        self.early: list[tuple] = []  # copies made between layers, for the next one (may precede its start)

    def begin(self, layer: int) -> dict | None:
        if not self.enabled:
            return None
        self.current = {"layer": layer, "copies": self.early, "compute": [], "start": self.mark(),
                        "host_start": time.perf_counter()}
        self.early = []
        self.layers.append(self.current)
        return self.current

    def end(self, prof: dict | None) -> None:
        if prof is not None:
            prof["end"] = self.mark()
            prof["host_s"] = time.perf_counter() - prof["host_start"]
            self.current = None

    def mark(self):
        if not self.enabled:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def copy_events(self, device, early: bool = False) -> tuple:
        """(started, ready) events for a copy that belongs to the layer being profiled (or, `early`, to the next
        one), else (None, None)."""
        if not self.enabled or (self.current is None and not early):
            return None, None
        started, ready = device.event(timing=True), device.event(timing=True)
        (self.early if early else self.current["copies"]).append((started, ready))
        return started, ready

    def resolve(self, device: torch.device) -> list[dict]:
        if not self.layers:
            return []
        torch.cuda.synchronize(device)
        out = []
        for p in self.layers:
            out.append({"layer": p["layer"], "copies": len(p["copies"]),
                        "copy_s": sum(a.elapsed_time(b) for a, b in p["copies"]) / 1e3,
                        "compute_s": sum(a.elapsed_time(b) for a, b in p["compute"]) / 1e3,
                        "wall_s": p["start"].elapsed_time(p["end"]) / 1e3, "host_s": p["host_s"]})
        self.layers = []
        return out
