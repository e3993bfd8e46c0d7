"""Record reads from a store file: O_DIRECT into page-aligned buffers, `os.preadv` (which releases the
GIL) from a thread pool. Where the filesystem refuses O_DIRECT the reader falls back to buffered reads
and says so (`direct` is False and `fallback_reason` tells why)."""

from __future__ import annotations

import errno
import os
import time

import torch

from moestream.errors import StoreError
from moestream.experts.memory import PAGE


class RecordReader:
    def __init__(self, path: str, stride: int, num_records: int, direct: bool = True):
        self.path, self.stride, self.num_records = path, stride, num_records
        self.fd_buffered = os.open(path, os.O_RDONLY)
        self.fd_direct, self.fallback_reason = None, None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd_direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                self.fallback_reason = f"O_DIRECT refused ({errno.errorcode.get(e.errno, e.errno)})"
        elif direct:
            self.fallback_reason = "O_DIRECT is not available on this platform"
        self.direct = self.fd_direct is not None

    def read(self, rid: int, dest: torch.Tensor) -> float:
        """Read record `rid` into `dest` (uint8, `stride` bytes); returns the seconds it took."""
        if not 0 <= rid < self.num_records:
            raise StoreError(f"record {rid} is outside {self.path} ({self.num_records} records)")
        view = memoryview(dest.numpy()).cast("B")
        aligned = dest.data_ptr() % PAGE == 0
        fd = self.fd_direct if self.direct and aligned else self.fd_buffered
        start = time.perf_counter()
        try:
            got = os.preadv(fd, [view], rid * self.stride)
        except OSError as e:
            if fd != self.fd_direct or e.errno != errno.EINVAL:
                raise StoreError(f"reading record {rid} of {self.path} failed: {e.strerror}") from None
            self.direct, self.fallback_reason = False, "O_DIRECT read refused (EINVAL)"
            got = os.preadv(self.fd_buffered, [view], rid * self.stride)
        if got != self.stride:
            raise StoreError(f"{self.path} is shorter than its manifest says: record {rid} at byte "
                             f"{rid * self.stride} returned {got} of {self.stride} bytes")
        return time.perf_counter() - start

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd_buffered):
            if fd is not None:
                os.close(fd)
        self.fd_direct = self.fd_buffered = None
