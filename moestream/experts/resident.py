"""The simplest provider: every record of the store loaded into one buffer at start.

Only for stores that fit in memory whole (tiny test models); it is the oracle that the streaming
provider's results are compared with."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from moestream.experts.grouping import ExpertBatch, batch_of, group_by_expert
from moestream.experts.store import Store


class ResidentProvider:
    def __init__(self, store: Store, precision: str, device: torch.device):
        self.layout = store.manifest.layouts[precision]
        self.geometry = store.manifest.geometry
        n = self.geometry.num_records
        data = np.fromfile(store.experts_path(precision), dtype=np.uint8, count=n * self.layout.stride)
        self.buffer = torch.from_numpy(data).view(n, self.layout.stride).to(device)
        assert os.path.getsize(store.experts_path(precision)) == n * self.layout.stride

    def batches(self, layer_slot: int, topk_ids: torch.Tensor, x: torch.Tensor) -> Iterator[ExpertBatch]:
        g = group_by_expert(topk_ids)
        slots = [self.geometry.rid(layer_slot, e) for e in g.experts]
        yield batch_of(g, list(range(len(g.experts))), self.buffer, self.layout, slots)
