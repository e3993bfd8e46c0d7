"""Fetching records into GPU slots: reader threads read disk into pinned host memory (a staging buffer or
a host-tier slot), then copy host -> device on the copy stream and record the slot's `ready` event.

A fetch is a future that completes once the copy is enqueued; the compute stream then waits on the
event, so the host never waits for a copy to finish. Host threads block only on disk reads and on
reusing a pinned buffer whose previous copy is still in flight (counted as ring wait). A host-tier hit
with nothing to wait for is enqueued by the caller itself: a hop through the reader threads costs more
than the copy's enqueue, and their contention for the GIL stalled the prefill ring.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

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


class Fetcher:
    def __init__(self, device: Device, readers: dict[str, RecordReader], host: HostTier | None, stats: ExpertStats,
                 threads: int, staging: int, fake: bool = False):
        self.device, self.readers, self.host, self.stats, self.fake = device, readers, host, stats, fake
        stride = max(r.stride for r in readers.values())
        self.staging = StagingPool(staging, stride, device.cuda, device) if host is None else None
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moestream-read")
        self.enqueue_lock = threading.Lock()

    def fetch(self, rid: int, precision: str, layer: int, dst: torch.Tensor, dst_last_use, wait_for: Future | None,
              ready, started=None) -> Future:
        """Fill `dst` (a device slot) with record `rid`; `ready` is recorded on the copy stream after the copy.

        `dst_last_use`: the compute event after the slot's last reader; `wait_for`: an earlier fetch into the
        same slot that must land first."""
        host_slot, host_wait, source = None, None, "disk"
        if self.host is not None:  # host-tier keys carry the precision: mixed mode keeps both
            host_slot, hit = self.host.slot_for((precision, rid))
            source = "host" if hit else "disk"
            host_wait = self.host.last_job[host_slot]
        job = (rid, precision, layer, dst, dst_last_use, wait_for, ready, source, host_slot, host_wait, started)
        if source == "host" and all(f is None or f.done() for f in (wait_for, host_wait)):
            future = Future()
            try:
                self._job(*job)
                future.set_result(None)
            except Exception as e:  # surfaces where the caller waits, as a reader thread's would
                future.set_exception(e)
        else:
            future = self.pool.submit(self._job, *job)
        if host_slot is not None:
            self.host.last_job[host_slot] = future
        return future

    def _job(self, rid, precision, layer, dst, dst_last_use, wait_for, ready, source, host_slot, host_wait, started):
        timeout = self.device.timeout_s
        for earlier in (wait_for, host_wait):
            if earlier is not None:
                earlier.result(timeout=timeout)
        reader = self.readers[precision]
        stride, waited = reader.stride, 0.0
        staging = None
        if host_slot is not None:
            buf = self.host.buffer[host_slot][:stride]
            if source == "disk":
                waited = self.device.host_wait(self.host.copy_event[host_slot], "copy out of the host tier")
        else:
            staging, waited = self.staging.acquire()
            buf = self.staging.buffers[staging][:stride]
        if source == "disk":
            seconds = 0.0 if self.fake else reader.read(rid, buf)
            self.stats.read(layer, precision, "disk", stride, seconds)
        else:
            self.stats.read(layer, precision, "host", stride)
        # One enqueue at a time: each copy's wait, start and ready events stay contiguous on the stream.
        with self.enqueue_lock, self.device.copy_context():
            self.device.wait_on_copy(dst_last_use)
            if started is not None:  # profiling: the copy's start on the copy stream
                started.record(self.device.copy_stream)
            if not self.fake:
                dst[:stride].copy_(buf, non_blocking=True)
            ready.record(self.device.copy_stream)
        if host_slot is not None:
            self.host.copy_event[host_slot] = ready
        else:
            self.staging.release(staging, ready)
        if waited:
            with self.stats.lock:
                self.stats.at(layer, precision).ring_wait_seconds += waited

    def fill_host(self, rid: int, precision: str, layer: int) -> Future:
        """Read record `rid` from disk into the host tier only (preloading for zero-copy reads)."""
        slot, _ = self.host.slot_for((precision, rid))
        wait = self.host.last_job[slot]

        def job():
            if wait is not None:
                wait.result(timeout=self.device.timeout_s)
            reader = self.readers[precision]
            seconds = 0.0 if self.fake else reader.read(rid, self.host.buffer[slot][: reader.stride])
            self.stats.read(layer, precision, "disk", reader.stride, seconds)

        future = self.pool.submit(job)
        self.host.last_job[slot] = future
        return future

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for r in self.readers.values():
            r.close()
