"""Routing traces: which experts every MoE layer routed each token to, as JSON lines.

The first line is a header `{"trace": "routing", "layers", "experts", "top_k", "prefill_min_rows"}` (the store's
record layers, experts per layer, the model's top-k, and the row count from which a layer step streams through the
prefill ring). Then one line per (layer, token), in the order the engine ran them:
`{"layer": L, "position": P, "step": S, "phase": "prefill"|"decode", "experts": [top_k ids]}`. `position` counts
the tokens layer L has processed; the lines of one layer step (one forward's rows at that layer) are consecutive
and share `step`, layer L's step count; `phase` is "prefill" for a step of more than one row. A prompt's forward
padded to a fixed size (engine/prefill.py) writes its own rows, each line with `"rows"`: the forward's. The last
sampled token is never fed back, so a request writes (prompt + generated - 1) x layers lines.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from typing import IO


class RoutingTrace:
    """Writes a trace to `sink`: a text file (JSON lines) or a list (one dict a line, header included)."""

    def __init__(self, sink: IO[str] | list, layers: int, experts: int, top_k: int, prefill_min_rows: int):
        self.sink, self.top_k = sink, top_k
        self.positions = [0] * layers
        self.steps = [0] * layers
        self._emit({"trace": "routing", "layers": layers, "experts": experts, "top_k": top_k,
                    "prefill_min_rows": prefill_min_rows})

    def _emit(self, record: dict) -> None:
        if isinstance(self.sink, list):
            self.sink.append(record)
        else:
            self.sink.write(json.dumps(record, separators=(",", ":")) + "\n")

    def step(self, layer: int, rows: list[list[int]], forward_rows: int | None = None) -> None:
        """One layer step: `rows` [T][top_k] expert ids, of a forward of `forward_rows` rows (default T)."""
        forward_rows = forward_rows or len(rows)
        phase = "prefill" if forward_rows > 1 else "decode"
        padded = {"rows": forward_rows} if forward_rows != len(rows) else {}
        for experts in rows:
            self._emit({"layer": layer, "position": self.positions[layer], "step": self.steps[layer],
                        "phase": phase, "experts": [int(e) for e in experts], **padded})
            self.positions[layer] += 1
        self.steps[layer] += 1


@dataclass(frozen=True)
class LayerStep:
    layer: int
    phase: str
    position: int  # of the first row
    rows: list[list[int]]  # [T][top_k]
    forward_rows: int | None = None  # a padded forward's rows (None: T)

    @property
    def size(self) -> int:
        """The rows the step's forward ran."""
        return self.forward_rows or len(self.rows)


@dataclass(frozen=True)
class Trace:
    layers: int
    experts: int
    top_k: int
    prefill_min_rows: int
    steps: list[LayerStep]  # in the order the engine ran them

    @property
    def records(self) -> int:
        return self.layers * self.experts


def parse(lines) -> Trace:
    """A trace from its JSON lines (strings) or dicts, the header first."""
    it = (json.loads(x) if isinstance(x, str) else x for x in lines if not isinstance(x, str) or x.strip())
    head = next(it, None)
    if not isinstance(head, dict) or head.get("trace") != "routing":
        raise ValueError("not a routing trace (its first line is not the header `generate --trace-routing` writes)")
    steps: list[LayerStep] = []
    key = None
    for rec in it:
        k = (rec["layer"], rec["step"])
        if k != key:
            steps.append(LayerStep(rec["layer"], rec["phase"], rec["position"], [], rec.get("rows")))
            key = k
        steps[-1].rows.append(list(rec["experts"]))
    return Trace(head["layers"], head["experts"], head["top_k"], head["prefill_min_rows"], steps)


def load(path: str) -> Trace:
    """A trace file, gzipped or not."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        try:
            return parse(f)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None
