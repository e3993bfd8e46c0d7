"""A rank's share of the experts: its grouping holds only its experts' entries, in the order the whole grouping
gives them; counters of several ranks add up leaf by leaf."""

import torch

from moestream.experts.grouping import group_by_expert
from moestream.experts.sharding import Shard, _sum


def test_a_ranks_grouping_is_the_whole_groupings_share():
    ids = torch.tensor([[3, 0], [2, 3], [1, 0], [5, 2]])
    whole = group_by_expert(ids, 6)
    for rank in range(3):
        keep = Shard(rank, 3).keep(6, ids.device)
        part = group_by_expert(ids, 6, keep)
        assert part.experts == [e for e in whole.experts if e % 3 == rank]
        for j, e in enumerate(part.experts):
            w = whole.experts.index(e)
            mine = part.order[part.offsets[j]: part.offsets[j + 1]]
            assert torch.equal(mine, whole.order[whole.offsets[w]: whole.offsets[w + 1]])


def test_counters_add_up_leaf_by_leaf():
    a = {"q4": {"hits": 1, "reads": {"host": {"bytes": 10}}}, "uses": [1, 0]}
    b = {"q4": {"hits": 2, "reads": {"host": {"bytes": 5}, "disk": {"bytes": 7}}}, "uses": [0, 3]}
    assert _sum([a, b]) == {"q4": {"hits": 3, "reads": {"host": {"bytes": 15}, "disk": {"bytes": 7}}}, "uses": [1, 3]}
