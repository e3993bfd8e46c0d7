"""Encoding one expert into its record bytes (pack time), for every precision the store keeps."""

from __future__ import annotations

import torch

from moestream.errors import SourceError
from moestream.experts.format import PROJECTIONS, RecordLayout
from moestream.packer.names import ExpertPlan, ExpertRef
from moestream.packer.sources import CheckpointSource
from moestream.quant.affine import quantize
from moestream.quant.lowbit import derive_codes


def read_projection(src: CheckpointSource, ref: ExpertRef, part: str = "weight") -> torch.Tensor:
    """One projection of one expert ([out, in] floats, or MLX weight/scales/biases)."""
    name = ref.name if part == "weight" else ref.name[: -len("weight")] + part
    if ref.index is None:
        return src.read(name)
    t = src.read(name, ref.index, ref.index + 1)[0]
    return t if ref.rows is None else t[ref.rows[0]: ref.rows[1]]


def encode_record(
    src: CheckpointSource, plan: ExpertPlan, layout: RecordLayout, slot: int, expert: int
) -> torch.Tensor:
    record = torch.zeros(layout.stride, dtype=torch.uint8)
    views = layout.views(record)
    for p in PROJECTIONS:
        ref = plan.refs[(slot, expert, p)]
        if plan.mlx:
            parts = {"w": read_projection(src, ref), "s": read_projection(src, ref, "scales"),
                     "b": read_projection(src, ref, "biases")}
            for k, t in parts.items():
                dst = views[f"{p}_{k}"]
                if tuple(t.shape) != tuple(dst.shape):
                    raise SourceError(f"{ref.name}: expert shape {tuple(t.shape)} does not match the config")
                dst.copy_(t.view(dst.dtype))
            continue
        w = read_projection(src, ref)
        if tuple(w.shape) != tuple(views[f"{p}_w"].shape if layout.bits == 16 else
                                   (views[f"{p}_w"].shape[0], views[f"{p}_s"].shape[1] * layout.group_size)):
            raise SourceError(f"{ref.name}: expert shape {tuple(w.shape)} does not match the config")
        if layout.bits == 16:
            views[f"{p}_w"].copy_(w.to(torch.bfloat16))
        else:
            packed, scales, biases = quantize(w, layout.bits, layout.group_size)
            views[f"{p}_w"].copy_(packed)
            views[f"{p}_s"].copy_(scales)
            views[f"{p}_b"].copy_(biases)
    return record


def derive_record(q4_record: torch.Tensor, q4: RecordLayout, low: RecordLayout) -> torch.Tensor:
    """Q3/Q2 records from Q4 ones ([..., stride] bytes): codes shifted right, scales and biases kept."""
    record = q4_record.new_zeros(*q4_record.shape[:-1], low.stride)
    src, dst = q4.views(q4_record), low.views(record)
    for p in PROJECTIONS:
        planes = derive_codes(src[f"{p}_w"], low.bits)
        dst[f"{p}_w"].copy_(planes[0])
        if low.bits == 3:
            dst[f"{p}_h"].copy_(planes[1])
        dst[f"{p}_s"].copy_(src[f"{p}_s"])
        dst[f"{p}_b"].copy_(src[f"{p}_b"])
    return record


def encode_all(src: CheckpointSource, plan: ExpertPlan, layouts: dict[str, RecordLayout], slot: int,
               expert: int) -> dict[str, torch.Tensor]:
    """Every requested precision of one expert; Q3/Q2 derive from the (possibly unstored) Q4 record."""
    out: dict[str, torch.Tensor] = {}
    low = [p for p, layout in layouts.items() if layout.bits in (2, 3)]
    q4 = layouts.get("q4")
    if low and q4 is None:
        any_layout = layouts[low[0]]
        q4 = RecordLayout.build("q4", any_layout.hidden_size, any_layout.intermediate_size)
    q4_record = encode_record(src, plan, q4, slot, expert) if q4 is not None and (low or "q4" in layouts) else None
    for p, layout in layouts.items():
        if p == "q4":
            out[p] = q4_record
        elif p in low:
            out[p] = derive_record(q4_record, q4, layout)
        else:
            out[p] = encode_record(src, plan, layout, slot, expert)
    return out
