"""Row reads from a PLE n-gram table file (`ngram.{layer}.bin`): only the rows asked for, never the table.

Real tables hold tens of GB, so a lookup preads each needed row (runs of consecutive ids in one read)
and returns them as float32. Rows are bf16, or MLX q4 `w | s | b`: `dim / 8` uint32 words of 4-bit
codes (low nibble first), then a bf16 scale and a bf16 bias per group, `value = scale * code + bias`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from moestream.errors import StoreError
from moestream.experts.format import NgramLayout
from moestream.quant.affine import unpack_codes


class NgramTable:
    def __init__(self, path: str, layout: NgramLayout):
        if layout.precision not in ("bf16", "q4"):
            raise StoreError(f"{path}: n-gram rows in {layout.precision!r} are not supported (bf16 or q4)")
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        if size != layout.rows * layout.row_bytes:
            raise StoreError(f"{path} holds {size} bytes, its layout says {layout.rows * layout.row_bytes}")
        self.path, self.layout = path, layout
        self.fd = os.open(path, os.O_RDONLY)
        self.rows_read = 0  # counters for tests and stats: rows and bytes fetched from the file
        self.bytes_read = 0

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] (int) -> float32 [..., dim], read from the file on the CPU."""
        flat = ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.layout.rows):
            raise IndexError(f"n-gram id out of range [0, {self.layout.rows}) in {self.path}")
        unique, inverse = torch.unique(flat, return_inverse=True)  # sorted, so runs are consecutive ids
        raw = self._read(unique.numpy())
        table = self._decode(torch.from_numpy(raw))
        return table[inverse].reshape(*ids.shape, self.layout.dim)

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

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [n, row_bytes] uint8 -> float32 [n, dim]."""
        dim = self.layout.dim
        if self.layout.precision == "bf16":
            return raw.view(torch.bfloat16).float()
        groups = dim // self.layout.group_size
        words = raw[:, : dim // 2].contiguous().view(torch.int32)
        scales = raw[:, dim // 2: dim // 2 + 2 * groups].contiguous().view(torch.bfloat16).float()
        biases = raw[:, dim // 2 + 2 * groups:].contiguous().view(torch.bfloat16).float()
        codes = unpack_codes(words, 4).float().view(-1, groups, self.layout.group_size)
        return (codes * scales[..., None] + biases[..., None]).view(-1, dim)
