"""Fetching records into GPU slots: reader threads read disk into pinned host memory (a staging buffer or
a host-tier slot), then copy host -> device on the copy stream and record the slot's `ready` event.

A fetch is a future that completes once the copy is enqueued; the compute stream then waits on the
event, so the host never waits for a copy to finish. Host threads block only on disk reads and on
reusing a pinned buffer whose previous copy is still in flight (counted as ring wait). Host-tier hits with
nothing to wait for are enqueued by the caller itself, in bulk: a hop through the reader threads costs
more than the copy's enqueue, and their contention for the GIL stalled the prefill ring.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moestream.experts.host import HostTier
from moestream.experts.memory import Device, host_buffer
from moestream.experts.reads import RecordReader
from moestream.stats.counters import ExpertStats


class StagingPool:
    """Pinned buffers for disk reads that have no host-tier slot to land in."""

    def __init__(self, count: int, stride: int, pinned: bool, device: Device):
        self.buffers = host_buffer(count * stride, pinned).view(count, stride)
        self.events = [None] * count
        self.free = list(range(count))
        self.cond = threading.Condition()
        self.device = device

    def acquire(self) -> tuple[int, float]:
        """A free buffer index and the seconds spent waiting for one."""
        with self.cond:
            while not self.free:
                if not self.cond.wait(timeout=self.device.timeout_s):
                    raise TimeoutError("no staging buffer was released in time")
            idx = self.free.pop()
        return idx, self.device.host_wait(self.events[idx], "copy out of a staging buffer")

    def release(self, idx: int, event) -> None:
        with self.cond:
            self.events[idx] = event
            self.free.append(idx)
            self.cond.notify()


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Fill `dst` (a device slot) with record `rid`. `dst_last_use`: the compute event after the slot's last
    reader; `wait_for`: an earlier fetch into the same slot that must land first."""

    rid: int
    precision: str
    layer: int
    dst: torch.Tensor
    dst_last_use: object
    wait_for: Future | None


ENQUEUED = Future()  # the future of a copy the caller enqueued itself
ENQUEUED.set_result(None)


def _settled(f: Future | None) -> bool:
    return f is None or f is ENQUEUED or (f.done() and not f.cancelled() and f.exception() is None)


class Fetcher:
    def __init__(self, device: Device, readers: dict[str, RecordReader], host: HostTier | None, stats: ExpertStats,
                 threads: int, staging: int, fake: bool = False):
        self.device, self.readers, self.host, self.stats, self.fake = device, readers, host, stats, fake
        stride = max(r.stride for r in readers.values())
        self.staging = StagingPool(staging, stride, device.cuda, device) if host is None else None
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moestream-read")
        self.enqueue_lock = threading.Lock()

    def fetch(self, requests: list[FetchRequest], events) -> list[tuple[Future, object]]:
        """(future, ready event) per request: the future is done once the copy is enqueued, the event (from
        `events() -> (started or None, ready)`) is recorded on the copy stream after it. Host-tier hits with
        nothing to wait for are enqueued here, at once (before a later request can evict their host slot), and a
        run of them shares one event, and copies between adjacent slots on both sides go as one; the rest go to
        the reader threads, which take the lock after this."""
        out, enqueued, waited, run, span = [], Counter(), None, None, None
        with self.enqueue_lock, self.device.copy_context():
            for r in requests:
                host_slot, host_wait, source = None, None, "disk"
                if self.host is not None:  # host-tier keys carry the precision: mixed mode keeps both
                    host_slot, hit = self.host.slot_for((r.precision, r.rid))
                    source = "host" if hit else "disk"
                    host_wait = self.host.last_job[host_slot]
                if source == "host" and _settled(r.wait_for) and _settled(host_wait):
                    if r.dst_last_use is not waited:  # a ring batch's slots share one: the stream waits once
                        self.device.wait_on_copy(r.dst_last_use)
                        waited = r.dst_last_use
                    if run is None:
                        run = self._start(events)
                    span = self._extend(span, r, self.host.views[host_slot])
                    self.host.copy_event[host_slot] = run[1]
                    enqueued[r.layer, r.precision] += 1
                    future, ready = ENQUEUED, run[1]
                else:
                    # a reader may overwrite a host slot this run copies from: the run's event first
                    self._finish(run, span)
                    run = span = None
                    started, ready = events()
                    future = self.pool.submit(self._job, r, source, host_slot, host_wait, started, ready)
                if host_slot is not None:
                    self.host.last_job[host_slot] = future
                out.append((future, ready))
            self._finish(run, span)
        for (layer, precision), n in enqueued.items():
            self.stats.read(layer, precision, "host", n * self.readers[precision].stride, records=n)
        return out

    def _start(self, events) -> tuple:
        """A run of copies enqueued back to back, timed from its `started` event when profiling."""
        run = events()
        if run[0] is not None:
            run[0].record(self.device.copy_stream)
        return run

    def _finish(self, run: tuple | None, span: tuple | None = None) -> None:
        self._flush(span)
        if run is not None:
            run[1].record(self.device.copy_stream)

    def _extend(self, span: tuple | None, r: FetchRequest, src: torch.Tensor) -> tuple | None:
        """Add r's whole-slot copy from `src` to `span` (first dst, first src, count) when both sides follow
        it in memory; else enqueue `span` and start another. One copy call costs ~8 us of host time."""
        if self.readers[r.precision].stride != r.dst.shape[0] or src.shape[0] != r.dst.shape[0]:
            self._flush(span)
            self._copy(r, src)
            return None
        if span is not None:
            dst0, src0, n = span
            size = dst0.shape[0]
            if r.dst.data_ptr() == dst0.data_ptr() + n * size and src.data_ptr() == src0.data_ptr() + n * size:
                return dst0, src0, n + 1
            self._flush(span)
        return r.dst, src, 1

    def _flush(self, span: tuple | None) -> None:
        """Enqueue the copy of a span of adjacent slots (the stream has waited for each slot's last reader)."""
        if span is None or self.fake:
            return
        dst0, src0, n = span
        size = dst0.shape[0]
        dst0.as_strided((n * size,), (1,)).copy_(src0.as_strided((n * size,), (1,)), non_blocking=True)

    def _copy(self, r: FetchRequest, src: torch.Tensor) -> None:
        """The copy of `src` into `r.dst` on the copy stream; the caller holds the lock and the stream, and has
        made the stream wait for the slot's last reader."""
        if not self.fake:
            stride = self.readers[r.precision].stride  # a low-bit record fills only the front of a slot
            if stride == r.dst.shape[0] == src.shape[0]:
                r.dst.copy_(src, non_blocking=True)
            else:
                r.dst[:stride].copy_(src[:stride], non_blocking=True)

    def _job(self, r: FetchRequest, source: str, host_slot: int | None, host_wait: Future | None, started,
             ready) -> None:
        timeout = self.device.timeout_s
        for earlier in (r.wait_for, host_wait):
            if earlier is not None:
                earlier.result(timeout=timeout)
        reader = self.readers[r.precision]
        stride, waited = reader.stride, 0.0
        staging = None
        if host_slot is not None:
            buf = self.host.views[host_slot]
            if source == "disk":
                waited = self.device.host_wait(self.host.copy_event[host_slot], "copy out of the host tier")
        else:
            staging, waited = self.staging.acquire()
            buf = self.staging.buffers[staging]
        if source == "disk":
            seconds = 0.0 if self.fake else reader.read(r.rid, buf[:stride])
            self.stats.read(r.layer, r.precision, "disk", stride, seconds)
        else:
            self.stats.read(r.layer, r.precision, "host", stride)
        # One enqueue at a time: each copy's wait, start and ready events stay contiguous on the stream.
        with self.enqueue_lock, self.device.copy_context():
            self.device.wait_on_copy(r.dst_last_use)
            if started is not None:
                started.record(self.device.copy_stream)
            self._copy(r, buf)
            ready.record(self.device.copy_stream)
        if host_slot is not None:
            self.host.copy_event[host_slot] = ready
        else:
            self.staging.release(staging, ready)
        if waited:
            with self.stats.lock:
                self.stats.at(r.layer, r.precision).ring_wait_seconds += waited

    def fill_host(self, rid: int, precision: str, layer: int) -> Future:
        """Read record `rid` from disk into the host tier only (preloading for zero-copy reads)."""
        slot, _ = self.host.slot_for((precision, rid))
        wait = self.host.last_job[slot]

        def job():
            if wait is not None:
                wait.result(timeout=self.device.timeout_s)
            reader = self.readers[precision]
            seconds = 0.0 if self.fake else reader.read(rid, self.host.views[slot][: reader.stride])
            self.stats.read(layer, precision, "disk", reader.stride, seconds)

        future = self.pool.submit(job)
        self.host.last_job[slot] = future
        return future

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for r in self.readers.values():
            r.close()
