"""The store format: one spec that the packer writes and the runtime reads.

A store folder holds `manifest.json` (written last), `dense.safetensors` (every non-expert tensor),
one fixed-stride record file per expert precision and, for qwen4_exp, one row file per n-gram table.
Record id `rid = layer_slot * num_experts + expert`; a record lives at `rid * stride`, and the stride
is a multiple of 4096 so that O_DIRECT reads land whole.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moestream.config import PRECISIONS, precision_name  # noqa: F401 (the store spec's precisions)

FORMAT_NAME = "moestream-store"
FORMAT_VERSION = 1
PAGE = 4096
FIELD_ALIGN = 64
GROUP_SIZE = 64
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
PROGRESS_FILE = ".pack-progress.json"

PROJECTIONS = ("gate", "up", "down")
DTYPES = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}



def experts_file(precision: str) -> str:
    return f"experts.{precision}.bin"


def ngram_file(layer: int) -> str:
    return f"ngram.{layer}.bin"


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class RecordLayout:
    """Where each tensor of one expert lives inside its record."""

    precision: str
    bits: int
    group_size: int
    hidden_size: int
    intermediate_size: int
    fields: tuple[Field, ...]
    record_bytes: int
    stride: int

    @classmethod
    def build(cls, precision: str, hidden: int, inter: int, group_size: int = GROUP_SIZE,
              scale_dtype: str = "bfloat16") -> RecordLayout:
        bits = PRECISIONS[precision]
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        specs: list[tuple[str, str, tuple[int, ...]]] = []
        if bits == 16:
            specs = [(f"{p}_w", "bfloat16", shapes[p]) for p in PROJECTIONS]
        else:
            for _, inp in shapes.values():
                if inp % group_size:
                    raise ValueError(f"{precision} experts need sizes that are multiples of {group_size} "
                                     f"(hidden {hidden}, intermediate {inter})")
            # Q3 keeps its low two bits like Q2 (`_w`) and its high bit in a plane of its own (`_h`).
            plane_bits = 2 if bits == 3 else bits
            specs = [(f"{p}_w", "int32", (shapes[p][0], shapes[p][1] * plane_bits // 32)) for p in PROJECTIONS]
            if bits == 3:
                specs += [(f"{p}_h", "int32", (shapes[p][0], shapes[p][1] // 32)) for p in PROJECTIONS]
            for p in PROJECTIONS:
                out, inp = shapes[p]
                specs += [(f"{p}_s", scale_dtype, (out, inp // group_size)),
                          (f"{p}_b", scale_dtype, (out, inp // group_size))]
        fields, offset = [], 0
        for name, dtype, shape in specs:
            f = Field(name, offset, dtype, shape)
            fields.append(f)
            offset = round_up(offset + f.nbytes, FIELD_ALIGN)
        return cls(precision, bits, group_size, hidden, inter, tuple(fields), offset, round_up(offset, PAGE))

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a record's bytes (uint8 [..., at least `record_bytes`]; leading dims are records)."""
        out = {}
        for f in self.fields:
            raw = record[..., f.offset: f.offset + f.nbytes]
            out[f.name] = raw.view(DTYPES[f.dtype]).unflatten(-1, f.shape)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fields"] = [asdict(f) for f in self.fields]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecordLayout:
        fields = tuple(Field(f["name"], f["offset"], f["dtype"], tuple(f["shape"])) for f in d["fields"])
        # the kernels read records with aligned vector loads: a misaligned field would fault on the GPU
        if d["stride"] % PAGE or any(f.offset % FIELD_ALIGN for f in fields):
            raise ValueError(f"{d['precision']} records are not {PAGE}-strided with {FIELD_ALIGN}-aligned fields")
        return cls(d["precision"], d["bits"], d["group_size"], d["hidden_size"], d["intermediate_size"],
                   fields, d["record_bytes"], d["stride"])


@dataclass(frozen=True)
class NgramLayout:
    """One PLE n-gram table: `rows` fixed-stride rows of `dim` values (bf16, or MLX q4 w|s|b)."""

    layer: int
    rows: int
    dim: int
    precision: str  # "bf16" or "q4"
    group_size: int
    row_bytes: int

    @classmethod
    def build(cls, layer: int, rows: int, dim: int, precision: str, group_size: int = 32) -> NgramLayout:
        if precision == "bf16":
            return cls(layer, rows, dim, precision, 0, dim * 2)
        return cls(layer, rows, dim, precision, group_size, dim // 2 + 2 * 2 * (dim // group_size))


@dataclass(frozen=True)
class ExpertGeometry:
    num_layers: int  # record layers: MoE decoder layers, then MTP layers
    num_experts: int
    hidden_size: int
    intermediate_size: int
    layer_ids: tuple[int, ...]  # decoder layer index of each record layer (-1 - k for MTP layer k)

    def rid(self, layer_slot: int, expert: int) -> int:
        return layer_slot * self.num_experts + expert

    @property
    def num_records(self) -> int:
        return self.num_layers * self.num_experts


@dataclass(frozen=True)
class FileCheck:
    size: int
    sha256: str  # of the whole file
    sample_sha256: str  # of sampled blocks (see `sample_blocks`), checked at load for large files


@dataclass(frozen=True)
class Manifest:
    model_type: str
    config: dict[str, Any]  # the source's HF config.json, unchanged
    source: dict[str, Any]
    dense_dtype: str
    geometry: ExpertGeometry
    layouts: dict[str, RecordLayout]  # precision -> layout
    ngram: tuple[NgramLayout, ...]
    tokenizer_files: tuple[str, ...]
    files: dict[str, FileCheck]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "model_type": self.model_type,
            "config": self.config,
            "source": self.source,
            "dense": {"file": DENSE_FILE, "dtype": self.dense_dtype},
            "experts": {**asdict(self.geometry),
                        "precisions": {k: v.to_json() for k, v in self.layouts.items()}},
            "ngram": [asdict(n) for n in self.ngram],
            "tokenizer_files": list(self.tokenizer_files),
            "files": {k: asdict(v) for k, v in self.files.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        e = d["experts"]
        geometry = ExpertGeometry(e["num_layers"], e["num_experts"], e["hidden_size"],
                                  e["intermediate_size"], tuple(e["layer_ids"]))
        return cls(
            model_type=d["model_type"],
            config=d["config"],
            source=d.get("source", {}),
            dense_dtype=d["dense"]["dtype"],
            geometry=geometry,
            layouts={k: RecordLayout.from_json(v) for k, v in e["precisions"].items()},
            ngram=tuple(NgramLayout(**n) for n in d.get("ngram", [])),
            tokenizer_files=tuple(d.get("tokenizer_files", [])),
            files={k: FileCheck(**v) for k, v in d["files"].items()},
            format_version=d["format_version"],
        )


SAMPLE_BLOCK = 1 << 16
SAMPLE_COUNT = 64


def sample_blocks(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks the quick checksum reads: evenly spaced, plus the tail."""
    if size <= SAMPLE_BLOCK * SAMPLE_COUNT:
        return [(0, size)]
    step = (size - SAMPLE_BLOCK) // (SAMPLE_COUNT - 1)
    return [(i * step, SAMPLE_BLOCK) for i in range(SAMPLE_COUNT - 1)] + [(size - SAMPLE_BLOCK, SAMPLE_BLOCK)]


def sample_sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for offset, length in sample_blocks(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def full_sha256(path: str, on_bytes=None) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()
