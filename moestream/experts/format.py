"""The store format: one spec that the packer writes and the runtime reads.

A store folder holds `manifest.json` (written last), `dense.safetensors` (every non-expert tensor),
one fixed-stride record file per expert precision and, for qwen4_exp, one row file per n-gram table.
Record id `rid = layer_slot * num_experts + expert`; a record lives at `rid * stride`, and the stride
is a multiple of 4096 so that O_DIRECT reads land whole.

The manifest carries `manifest_sha256`, a sha256 of its own canonical JSON (every other field, sorted keys,
fixed separators): `Manifest.to_json` and `write_manifest` add it, `Manifest.from_json` refuses a manifest
without it or edited after it was written, and every field whose type, range or agreement with the others
is wrong, with a `ManifestError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from moestream.config import PRECISIONS, precision_name  # noqa: F401 (the store spec's precisions)

FORMAT_NAME = "moestream-store"
FORMAT_VERSION = 2  # 2: the manifest carries its own checksum
PAGE = 4096
FIELD_ALIGN = 64
GROUP_SIZE = 64
MANIFEST = "manifest.json"
MANIFEST_SHA256 = "manifest_sha256"
DENSE_FILE = "dense.safetensors"
PROGRESS_FILE = ".pack-progress.json"

PROJECTIONS = ("gate", "up", "down")
DTYPES = {"int32": torch.int32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
DENSE_DTYPES = ("bfloat16", "float16", "float32")


class ManifestError(ValueError):
    """A manifest this version cannot read: the message names the field and what is wrong with it."""


def _at(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _object(value: Any, where: str, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A JSON object; with `fields`, exactly those (the object is the writer's, so anything else is an edit)."""
    if not isinstance(value, dict):
        raise ManifestError(f"{where or 'the manifest'} must be a JSON object, got {_shown(value)}")
    if keys is not None:
        if missing := [k for k in keys if k not in value]:
            raise ManifestError(f"{_at(where, missing[0])} is missing")
        if extra := [k for k in value if k not in keys]:
            raise ManifestError(f"{where or 'the manifest'} has a field the format does not define: {_shown(extra[0])}")
    return value


def _integer(value: Any, name: str, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ManifestError(f"{name} must be an integer{f' >= {minimum}' if minimum is not None else ''}, "
                            f"got {_shown(value)}")
    return value


def _int(d: dict[str, Any], key: str, where: str, minimum: int | None = 0) -> int:
    return _integer(d[key], _at(where, key), minimum)


def _str(d: dict[str, Any], key: str, where: str, choices: tuple[str, ...] | None = None) -> str:
    value = d[key]
    if not isinstance(value, str) or (choices is not None and value not in choices):
        want = "one of " + ", ".join(choices) if choices else "a string"
        raise ManifestError(f"{_at(where, key)} must be {want}, got {_shown(value)}")
    return value


def _list(d: dict[str, Any], key: str, where: str) -> list[Any]:
    if not isinstance(d[key], list | tuple):  # a tuple: `to_json`'s own output, read back without JSON
        raise ManifestError(f"{_at(where, key)} must be a list, got {_shown(d[key])}")
    return d[key]


def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _first_difference(have, want) -> str:
    """Where two layouts first differ, as `name is have, expected want` (into a record's fields)."""
    name = next(f for f in _names(type(want)) if getattr(have, f) != getattr(want, f))
    a, b = getattr(have, name), getattr(want, name)
    if name == "fields" and len(a) != len(b):
        return f"fields has {len(a)} entries, expected {len(b)}"
    if name == "fields":
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        return f"fields[{i}].{_first_difference(a[i], b[i])}"
    return f"{name} is {_shown(a)}, expected {_shown(b)}"


def manifest_digest(d: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, fixed separators), its own checksum left out."""
    body = {k: v for k, v in d.items() if k != MANIFEST_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(d: dict[str, Any]) -> dict[str, Any]:
    """The manifest `d` with its checksum (re)computed."""
    return {**{k: v for k, v in d.items() if k != MANIFEST_SHA256}, MANIFEST_SHA256: manifest_digest(d)}


def write_manifest(folder: str, manifest: Manifest | dict[str, Any]) -> None:
    """Write `folder/manifest.json`, sealed with its checksum, atomically (a temp file, fsync, rename)."""
    body = manifest.to_json() if isinstance(manifest, Manifest) else sealed(manifest)
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


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

    @classmethod
    def from_json(cls, d: Any, where: str) -> Field:
        d = _object(d, where, _names(cls))
        shape = tuple(_integer(n, f"{where}.shape[{i}]", 1) for i, n in enumerate(_list(d, "shape", where)))
        return cls(_str(d, "name", where), _int(d, "offset", where), _str(d, "dtype", where, tuple(DTYPES)), shape)


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
    def from_json(cls, d: Any, where: str = "layout") -> RecordLayout:
        d = _object(d, where, _names(cls))
        parts = tuple(Field.from_json(f, f"{where}.fields[{i}]") for i, f in enumerate(_list(d, "fields", where)))
        layout = cls(_str(d, "precision", where, tuple(PRECISIONS)), *(_int(d, k, where, 1) for k in (
            "bits", "group_size", "hidden_size", "intermediate_size")), parts, _int(d, "record_bytes", where, 1),
            _int(d, "stride", where, 1))
        # the kernels read records with aligned vector loads: a misaligned field would fault on the GPU
        if layout.stride % PAGE or any(f.offset % FIELD_ALIGN for f in parts):
            raise ManifestError(f"{where}: {layout.precision} records are not {PAGE}-strided with "
                                f"{FIELD_ALIGN}-aligned fields")
        return layout


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

    @classmethod
    def from_json(cls, d: Any, where: str) -> NgramLayout:
        d = _object(d, where, _names(cls))
        precision = _str(d, "precision", where, ("bf16", "q4"))
        layout = cls(_int(d, "layer", where), _int(d, "rows", where, 1), _int(d, "dim", where, 1), precision,
                     _int(d, "group_size", where), _int(d, "row_bytes", where, 1))
        # q4 rows are whole uint32 words of codes and whole groups
        if precision == "q4" and (layout.dim % 8 or not layout.group_size or layout.dim % layout.group_size):
            raise ManifestError(f"{where}: q4 rows of dim {layout.dim} need a dim that is a multiple of 8 and of "
                                f"group_size {layout.group_size}")
        want = cls.build(layout.layer, layout.rows, layout.dim, precision, layout.group_size)
        if layout != want:
            raise ManifestError(f"{where}: {_first_difference(layout, want)}")
        return layout


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

    @classmethod
    def from_json(cls, d: Any, where: str) -> FileCheck:
        d = _object(d, where, _names(cls))
        for key in ("sha256", "sample_sha256"):
            value = _str(d, key, where)
            if len(value) != 64 or value.strip("0123456789abcdef"):
                raise ManifestError(f"{_at(where, key)} must be 64 hex digits, got {_shown(value)}")
        return cls(_int(d, "size", where), d["sha256"], d["sample_sha256"])


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
        """The manifest as written: every field, then `manifest_sha256` over them."""
        body = {
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
        return sealed(body)

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Read a manifest: its format, version and checksum first, then every field (a ManifestError names it)."""
        d = _object(d, "")
        if d.get("format") != FORMAT_NAME:
            raise ManifestError(f"not a moestream manifest (format is {_shown(d.get('format'))})")
        version = d.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise ManifestError(f"store format version {_shown(version)}, this moestream reads version "
                                f"{FORMAT_VERSION}; pack the checkpoint again")
        if d.get(MANIFEST_SHA256) != manifest_digest(d):
            problem = "checksum mismatch" if MANIFEST_SHA256 in d else f"no {MANIFEST_SHA256}"
            raise ManifestError(f"edited after pack ({problem}); pack the checkpoint again")
        d = _object(d, "", TOP_FIELDS)
        dense = _object(d["dense"], "dense", ("file", "dtype"))
        _str(dense, "file", "dense", (DENSE_FILE,))
        e = _object(d["experts"], "experts", (*_names(ExpertGeometry), "precisions"))
        ids = tuple(_integer(n, f"experts.layer_ids[{i}]", None)
                    for i, n in enumerate(_list(e, "layer_ids", "experts")))
        geometry = ExpertGeometry(*(_int(e, k, "experts", 1) for k in _names(ExpertGeometry)[:4]), ids)
        if len(ids) != geometry.num_layers or len(set(ids)) != len(ids):
            raise ManifestError(f"experts.layer_ids must be {geometry.num_layers} distinct layers, got {_shown(ids)}")
        layouts = {}
        for key, value in _object(e["precisions"], "experts.precisions").items():
            if key not in PRECISIONS:
                raise ManifestError(f"experts.precisions holds an unknown precision {_shown(key)}")
            layouts[key] = RecordLayout.from_json(value, f"experts.precisions.{key}")
            _check_built(layouts[key], key, geometry, f"experts.precisions.{key}")
        if not layouts:
            raise ManifestError("experts.precisions is empty")
        ngram = tuple(NgramLayout.from_json(n, f"ngram[{i}]") for i, n in enumerate(_list(d, "ngram", "")))
        if len({n.layer for n in ngram}) != len(ngram):
            raise ManifestError("ngram lists a layer twice")
        tokenizer = tuple(_list(d, "tokenizer_files", ""))
        for i, name in enumerate(tokenizer):
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") or "\\" in name:
                raise ManifestError(f"tokenizer_files[{i}] must be a file name in the store, got {_shown(name)}")
        return cls(_str(d, "model_type", ""), _object(d["config"], "config"), _object(d["source"], "source"),
                   _str(dense, "dtype", "dense", DENSE_DTYPES), geometry, layouts, ngram, tokenizer,
                   _file_checks(d["files"], geometry, layouts, ngram, tokenizer), version)


TOP_FIELDS = ("format", "format_version", MANIFEST_SHA256, "model_type", "config", "source", "dense", "experts",
              "ngram", "tokenizer_files", "files")


def _check_built(layout: RecordLayout, precision: str, g: ExpertGeometry, where: str) -> None:
    """Refuse a layout other than the one this version builds for its precision and the experts' sizes."""
    try:
        want = RecordLayout.build(precision, g.hidden_size, g.intermediate_size)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from None
    if layout != want:
        raise ManifestError(f"{where}: {_first_difference(layout, want)} for {g.hidden_size} x "
                            f"{g.intermediate_size} experts")


def _file_checks(files: Any, g: ExpertGeometry, layouts: dict[str, RecordLayout], ngram: tuple[NgramLayout, ...],
                 tokenizer: tuple[str, ...]) -> dict[str, FileCheck]:
    """One check per file the manifest describes (tokenizer files optional), each record or row file as long as
    its layout says."""
    sizes = {DENSE_FILE: None, **{experts_file(p): g.num_records * layout.stride for p, layout in layouts.items()},
             **{ngram_file(n.layer): n.rows * n.row_bytes for n in ngram}}
    files = _object(files, "files")
    if missing := [name for name in sizes if name not in files]:
        raise ManifestError(f"files.{missing[0]} is missing (the file's size and checksum)")
    if extra := [name for name in files if name not in sizes and name not in tokenizer]:
        raise ManifestError(f"files lists {_shown(extra[0])}, which no other field of the manifest describes")
    checks = {name: FileCheck.from_json(value, f"files.{name}") for name, value in files.items()}
    for name, size in sizes.items():
        if size is not None and checks[name].size != size:
            raise ManifestError(f"files.{name}.size is {checks[name].size}, its layout makes it {size} bytes")
    return checks


SAMPLE_BLOCK = 1 << 16
SAMPLE_COUNT = 64


def sample_blocks(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks the quick checksum reads: evenly spaced, plus the tail."""
    if size <= SAMPLE_BLOCK * SAMPLE_COUNT:
        return [(0, size)]
    step = (size - SAMPLE_BLOCK) // (SAMPLE_COUNT - 1)
    return [(i * step, SAMPLE_BLOCK) for i in range(SAMPLE_COUNT - 1)] + [(size - SAMPLE_BLOCK, SAMPLE_BLOCK)]


def sample_sha256(path: str) -> str:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for offset, length in sample_blocks(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def full_sha256(path: str, on_bytes=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()
