"""The dense side of a pack: every non-expert tensor into one safetensors file, and the PLE n-gram
tables into row-addressable files (never whole in memory: they reach tens of GB)."""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from moestream.errors import SourceError
from moestream.experts.format import NgramLayout, ngram_file
from moestream.packer.names import NGRAM, ExpertPlan
from moestream.packer.safetensors_io import SafetensorsWriter
from moestream.packer.sources import CheckpointSource

NGRAM_CHUNK_ROWS = 1 << 16


def dense_names(src: CheckpointSource, plan: ExpertPlan) -> list[str]:
    out = []
    for name in sorted(src.tensors):
        if name in plan.expert_tensors or NGRAM.match(name):
            continue
        if name.endswith((".scales", ".biases")) and src.kind == "mlx":
            continue  # consumed when their `.weight` is dequantized
        if ".switch_mlp." in name:
            continue
        out.append(name)
    return out


def _dense_dtype(src: CheckpointSource, name: str, dtype: torch.dtype) -> torch.dtype:
    from moestream.packer.safetensors_io import ST_DTYPES

    raw = ST_DTYPES[src.tensors[name].dtype]
    if src.kind == "mlx" and src.is_quantized(name):
        return dtype
    return dtype if raw.is_floating_point else raw


def write_dense(src: CheckpointSource, names: list[str], path: str, dtype: torch.dtype, ui) -> None:
    ui.phase("packing dense tensors")
    specs = [(n, _dense_dtype(src, n, dtype), src.dense_shape(n)) for n in names]
    partial = path + ".partial"
    writer = SafetensorsWriter(partial, specs)
    for name, dt, _ in specs:
        writer.write(name, src.dense(name).to(dt))
        ui.advance(src.tensors[name].nbytes)
    writer.close()
    os.replace(partial, path)


def write_ngram_tables(src: CheckpointSource, out: str, ui) -> list[NgramLayout]:
    shards: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for name in src.tensors:
        if (m := NGRAM.match(name)) and m[3] == "weight":
            shards[int(m[1])].append((int(m[2] or 0), name))
    layouts = []
    for layer, parts in sorted(shards.items()):
        ui.phase(f"packing n-gram table of layer {layer}")
        parts.sort()
        first = src.tensors[parts[0][1]]
        quantized = src.kind == "mlx" and src.is_quantized(parts[0][1])
        dim = src.dense_shape(parts[0][1])[-1]
        rows = sum(src.tensors[n].shape[0] for _, n in parts)
        if quantized:
            bits, group = src.quant_params(parts[0][1][: -len(".weight")])
            if bits != 4:
                raise SourceError(f"{parts[0][1]}: {bits}-bit n-gram tables are not supported (4-bit only)")
            layout = NgramLayout.build(layer, rows, dim, "q4", group)
        elif first.dtype in ("BF16", "F16", "F32"):
            layout = NgramLayout.build(layer, rows, dim, "bf16")
        else:
            raise SourceError(f"{parts[0][1]}: n-gram table dtype {first.dtype} is not supported")
        with open(os.path.join(out, ngram_file(layer)), "wb") as f:
            for _, name in parts:
                n = src.tensors[name].shape[0]
                for start in range(0, n, NGRAM_CHUNK_ROWS):
                    stop = min(n, start + NGRAM_CHUNK_ROWS)
                    f.write(_ngram_rows(src, name, start, stop, quantized))
            f.flush()
            os.fsync(f.fileno())
        layouts.append(layout)
    return layouts


def _ngram_rows(src: CheckpointSource, name: str, start: int, stop: int, quantized: bool) -> bytes:
    if not quantized:
        return src.read(name, start, stop).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    base = name[: -len("weight")]
    parts = [src.read(base + p, start, stop).contiguous().view(torch.uint8) for p in ("weight", "scales", "biases")]
    return torch.cat(parts, dim=1).numpy().tobytes()
