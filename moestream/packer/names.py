"""Which checkpoint tensors are routed experts, and where each goes in the store.

Experts come per expert (`mlp.experts.{e}.gate_proj.weight`), fused (`mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I]) or MLX-stacked (`mlp.switch_mlp.gate_proj.weight`
with `.scales`/`.biases`). Record layers are the MoE decoder layers in order, then the MTP layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moestream.config import ModelConfig
from moestream.errors import SourceError
from moestream.experts.format import PROJECTIONS

_PER_EXPERT = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_MLX = re.compile(r"^(model|mtp)\.layers\.(\d+)\.mlp\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases)$")
NGRAM = re.compile(
    r"^model\.layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding(?:\.shard_(\d+))?\.(weight|scales|biases)$"
)


@dataclass(frozen=True)
class ExpertRef:
    """Where one projection of one expert lives: a tensor, and a row range when it is stacked."""

    name: str  # tensor name (for MLX: the `.weight`; scales/biases are its siblings)
    index: int | None  # expert index along dim 0 of a stacked tensor, or None
    rows: tuple[int, int] | None  # row range within that expert (fused gate_up halves)


@dataclass(frozen=True)
class ExpertPlan:
    layer_ids: tuple[int, ...]  # decoder layer (or -1-k for MTP layer k) of each record layer
    refs: dict[tuple[int, int, str], ExpertRef]  # (record layer, expert, projection) -> ref
    expert_tensors: frozenset[str]  # every tensor consumed by experts
    mlx: bool


def plan_experts(names: list[str], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> ExpertPlan:
    mtp_layers = sorted({int(m.group(2)) for n in names
                         if (m := _PER_EXPERT.match(n) or _FUSED.match(n) or _MLX.match(n)) and m.group(1) == "mtp"})
    slot_of = {("model", layer): s for s, layer in enumerate(cfg.moe_layer_ids)}
    base = len(cfg.moe_layer_ids)
    slot_of.update({("mtp", k): base + i for i, k in enumerate(mtp_layers)})
    layer_ids = tuple(cfg.moe_layer_ids) + tuple(-1 - k for k in mtp_layers)
    inter = cfg.moe_intermediate_size
    refs: dict[tuple[int, int, str], ExpertRef] = {}
    used: set[str] = set()
    mlx = False

    def slot(kind: str, layer: str, name: str) -> int:
        key = (kind, int(layer))
        if key not in slot_of:
            raise SourceError(f"{name}: routed experts on layer {layer}, which the config says is dense")
        return slot_of[key]

    for n in names:
        if m := _PER_EXPERT.match(n):
            refs[(slot(m[1], m[2], n), int(m[3]), m[4])] = ExpertRef(n, None, None)
        elif m := _FUSED.match(n):
            s = slot(m[1], m[2], n)
            for e in range(shapes[n][0]):
                if m[3] == "down_proj":
                    refs[(s, e, "down")] = ExpertRef(n, e, None)
                else:
                    refs[(s, e, "gate")] = ExpertRef(n, e, (0, inter))
                    refs[(s, e, "up")] = ExpertRef(n, e, (inter, 2 * inter))
        elif m := _MLX.match(n):
            mlx = True
            if m[4] == "weight":
                s = slot(m[1], m[2], n)
                for e in range(shapes[n][0]):
                    refs[(s, e, m[3])] = ExpertRef(n, e, None)
        else:
            continue
        used.add(n)
    for s in range(len(layer_ids)):
        for e in range(cfg.num_experts):
            for p in PROJECTIONS:
                if (s, e, p) not in refs:
                    layer = layer_ids[s]
                    where = f"model.layers.{layer}" if layer >= 0 else f"mtp.layers.{-1 - layer}"
                    raise SourceError(f"missing tensor {where}.mlp.experts.{e}.{p}_proj.weight")
    return ExpertPlan(layer_ids, refs, frozenset(used), mlx)
