"""Streaming safetensors access with bounded memory.

The safetensors library maps whole files, and every mapped page read counts towards RSS; packing
reads tensors (or row ranges of stacked expert tensors) with `pread` instead, and writes the dense
file tensor by tensor behind a header computed up front.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from moestream.errors import SourceError

ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U32": torch.uint32, "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    path: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Every tensor's place in a safetensors file; a header that does not fit the file is refused, never trusted."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > MAX_HEADER_BYTES:
                why = f"the file has {size}" if n > size - 8 else f"at most {MAX_HEADER_BYTES} are allowed"
                raise SourceError(f"{path}: not a safetensors file (its header claims {n} bytes; {why})")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise SourceError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return {name: _tensor_info(path, name, meta, 8 + n, size)
            for name, meta in header.items() if name != "__metadata__"}


def _tensor_info(path: str, name: str, meta, base: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        ok = isinstance(dtype, str) and all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise SourceError(f"{path}: tensor {name} has a malformed header entry")
    if not begin <= end <= size - base:
        raise SourceError(f"{path}: tensor {name} lies past the end of the file (data bytes {begin}..{end} of "
                          f"{size - base}); the file is truncated or corrupt")
    if dtype in ST_DTYPES and end - begin != math.prod(shape) * ST_DTYPES[dtype].itemsize:
        raise SourceError(f"{path}: tensor {name} holds {end - begin} bytes, its shape {list(shape)} "
                          f"of {dtype} needs {math.prod(shape) * ST_DTYPES[dtype].itemsize}")
    return TensorInfo(path, dtype, shape, base + begin, end - begin)


def _as_tensor(buf: bytearray, info: TensorInfo, shape: tuple[int, ...]) -> torch.Tensor:
    if info.dtype not in ST_DTYPES:
        raise SourceError(f"{info.path}: tensor dtype {info.dtype} is not supported")
    if not buf:
        return torch.empty(shape, dtype=ST_DTYPES[info.dtype])
    return torch.frombuffer(buf, dtype=ST_DTYPES[info.dtype]).view(shape)


def read_rows(info: TensorInfo, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) along dim 0 of a tensor, read with pread (no mapping)."""
    rows = info.shape[0] if info.shape else 1
    stop = rows if stop is None else stop
    row_bytes = info.nbytes // max(rows, 1)
    length = (stop - start) * row_bytes
    buf = bytearray(length)
    with open(info.path, "rb", buffering=0) as f:
        got = os.preadv(f.fileno(), [buf], info.start + start * row_bytes) if length else 0
    if got != length:
        raise SourceError(f"{info.path}: file is shorter than its header says")
    shape = ((stop - start), *info.shape[1:]) if info.shape else ()
    return _as_tensor(buf, info, shape)


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order given to the constructor."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        self.order = [name for name, _, _ in specs]
        for name, dtype, shape in specs:
            n = dtype.itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.header, self.next = header, 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.next]
        assert name == expected, f"tensor {name} written out of order (expected {expected})"
        meta = self.header[name]
        assert list(tensor.shape) == meta["shape"] and TORCH_TO_ST[tensor.dtype] == meta["dtype"], name
        self.f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.next += 1

    def close(self) -> None:
        assert self.next == len(self.order), "dense file closed before every tensor was written"
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
