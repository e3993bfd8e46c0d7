"""Host buffers and the CUDA plumbing the expert subsystem needs, with CPU stand-ins.

On CUDA: pinned, page-aligned host memory, a copy stream, and real events. On CPU: page-aligned
anonymous mappings, and events and streams that do nothing (copies there are synchronous).
"""

from __future__ import annotations

import contextlib
import mmap
import time

import torch

from moestream.errors import MoestreamError

PAGE = 4096


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A page-aligned uint8 host tensor (pinned when `pinned`), so that O_DIRECT reads can land in it.
    Pinned memory is an anonymous mapping registered with CUDA: torch's pinned allocator rounds every
    request up to a power of two, so a 70 GB host tier would ask for 128 GiB."""
    mm = (_PinnedMapping if pinned else mmap.mmap)(-1, max(nbytes, 1))
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    if pinned and nbytes:
        mm.register(t.data_ptr(), nbytes)
    t._moestream_mmap = mm  # keep the mapping alive as long as the tensor
    return t


class _PinnedMapping(mmap.mmap):
    """An anonymous mapping that stays page-locked for CUDA from `register` until it is freed."""

    ptr = None

    def register(self, ptr: int, nbytes: int) -> None:
        if err := int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)):
            with contextlib.suppress(RuntimeError):  # a launch check consumes the failure, else the next one reports it
                torch.zeros(1, device="cuda")
            raise MoestreamError(f"cannot pin {nbytes / 1e9:.1f} GB of host memory (CUDA error {err}): "
                                 "ask for a smaller --host-gb")
        self.ptr = ptr

    def __del__(self) -> None:  # before the base class unmaps the pages
        if self.ptr is not None:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone before us
                torch.cuda.cudart().cudaHostUnregister(self.ptr)


class NullEvent:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Device:
    """Streams and events for one device; on CPU every wait is immediate."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else NullEvent()

    def compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def copy_context(self):
        return torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()

    def wait_on_copy(self, event) -> None:
        """Make the copy stream wait for `event` (recorded on the compute stream)."""
        if self.cuda and event is not None:
            self.copy_stream.wait_event(event)

    def wait_on_compute(self, event) -> None:
        """Make the compute stream wait for `event` (recorded on the copy stream)."""
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event, what: str) -> float:
        """Block this thread until `event` completes, with the I/O timeout; returns seconds waited."""
        if event is None or event.query():
            return 0.0
        start, delay = time.perf_counter(), 1e-5
        while not event.query():
            if time.perf_counter() - start > self.timeout_s:
                raise MoestreamError(f"GPU {what} did not finish within {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return time.perf_counter() - start
