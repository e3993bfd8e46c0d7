"""A PLE n-gram table (`ngram.{layer}.bin`): fixed-stride rows, bf16 or MLX q4 `w | s | b` (decoded by
`kernels.ops.ngram_rows`).

Real tables hold tens of GB. On the host tier the whole table is read once into pinned host memory, where the
GPU reads the rows each token needs in place (inside the decode graph); on disk, each forward preads only the
rows it needs (runs of consecutive ids in one read), and a decode step's rows are read as soon as its token is
known, into a small staging buffer on the device that the step reads. Rows are counted per tier: disk reads
on the host, rows read in place by a device counter, since a graph replay runs no Python.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from moestream.errors import StoreError
from moestream.experts.format import NgramLayout
from moestream.experts.memory import host_buffer

LOAD_CHUNK = 1 << 28  # bytes a read of the whole table asks for at a time


class NgramTable:
    def __init__(self, path: str, layout: NgramLayout):
        if layout.precision not in ("bf16", "q4"):
            raise StoreError(f"{path}: n-gram rows in {layout.precision!r} are not supported (bf16 or q4)")
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        if size != layout.rows * layout.row_bytes:
            raise StoreError(f"{path} holds {size} bytes, its layout says {layout.rows * layout.row_bytes}")
        self.path, self.layout = path, layout
        self.fd = os.open(path, os.O_RDONLY)
        self.host = None  # the whole table [rows, row_bytes] when it lives on the host tier
        self.rows_read = 0  # disk: distinct rows and bytes read from the file
        self.bytes_read = 0
        self.host_rows = None  # host tier: rows read in place, counted on the compute device
        self.staging = None  # disk tier: a decode step's rows on the compute device (make_staging)

    @property
    def nbytes(self) -> int:
        return self.layout.rows * self.layout.row_bytes

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def load_host(self, device: torch.device, advance=None) -> None:
        """Read the whole table into host memory (pinned when `device` is CUDA, so kernels read it in place);
        `advance(bytes_done)` reports progress."""
        self.host = host_buffer(self.nbytes, device.type == "cuda").view(self.layout.rows, self.layout.row_bytes)
        flat = self.host.view(-1).numpy()
        for start in range(0, self.nbytes, LOAD_CHUNK):
            end = min(start + LOAD_CHUNK, self.nbytes)
            if os.preadv(self.fd, [memoryview(flat[start:end])], start) != end - start:
                raise StoreError(f"{self.path} ended early at byte {start}")
            if advance:
                advance(end)
        self.host_rows = torch.zeros((), dtype=torch.long, device=device)

    def make_staging(self, rows: int, device: torch.device) -> None:
        """Disk tier: room for one decode step's `rows` rows on the device, filled from pinned memory by `stage`."""
        self.staging_host = host_buffer(rows * self.layout.row_bytes, device.type == "cuda").view(rows, -1)
        self.staging = torch.zeros(rows, self.layout.row_bytes, dtype=torch.uint8, device=device)
        self.staging_ids = torch.arange(rows, device=device)[None]
        self.staged = None  # the last copy's event: the pinned rows are not rewritten before it ends

    def stage(self, raw: torch.Tensor) -> None:
        """A step's rows [rows, row_bytes] into the staging buffer, copied on the current stream."""
        if self.staged is not None:
            self.staged.synchronize()
        self.staging_host.copy_(raw)
        self.staging.copy_(self.staging_host, non_blocking=True)
        if self.staging.is_cuda:
            self.staged = torch.cuda.Event()
            self.staged.record()

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [...] (int) -> (the distinct rows' bytes [n, row_bytes] uint8, read from the file, and each id's
        index among them [...])."""
        flat = ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.layout.rows):
            raise IndexError(f"n-gram id out of range [0, {self.layout.rows}) in {self.path}")
        unique, inverse = torch.unique(flat, return_inverse=True)  # sorted, so runs are consecutive ids
        return torch.from_numpy(self._read(unique.numpy())), inverse.view(ids.shape)

    def _read(self, ids: np.ndarray) -> np.ndarray:
        """Sorted unique row ids [n] -> their bytes [n, row_bytes]."""
        width = self.layout.row_bytes
        out = np.empty((len(ids), width), dtype=np.uint8)
        starts = np.flatnonzero(np.diff(ids, prepend=-2) != 1)  # first index of each run of consecutive ids
        ends = np.append(starts[1:], len(ids))
        for a, b in zip(starts.tolist(), ends.tolist()):
            data = os.pread(self.fd, (b - a) * width, int(ids[a]) * width)
            out[a:b] = np.frombuffer(data, dtype=np.uint8).reshape(b - a, width)
        self.rows_read += len(ids)
        self.bytes_read += len(ids) * width
        return out

    def reset_counts(self) -> None:
        self.rows_read = self.bytes_read = 0
        if self.host_rows is not None:
            self.host_rows.zero_()

    def counts(self) -> dict:
        """Rows and bytes read per tier."""
        host = int(self.host_rows) if self.host_rows is not None else 0
        return {"host": {"rows": host, "bytes": host * self.layout.row_bytes},
                "disk": {"rows": self.rows_read, "bytes": self.bytes_read}}
