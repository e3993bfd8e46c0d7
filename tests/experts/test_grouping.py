"""Routing entries grouped by expert (experts/grouping.py)."""

import pytest
import torch

from moestream.experts.grouping import expert_order


@pytest.mark.parametrize("experts", [128, 255, 512])
def test_expert_order_on_narrow_keys_is_the_stable_sort_of_the_ids(experts):
    ids = torch.randint(0, experts + 1, (4096 * 8,), generator=torch.Generator().manual_seed(experts))  # + sentinel
    assert torch.equal(expert_order(ids, experts), torch.argsort(ids, stable=True))
