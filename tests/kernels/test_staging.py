"""Staging a batched step's host-tier records: the plan (which distinct ids take which device slot, in order of
first entry, the rest read in place) equals its torch reference, and each staged slot holds its record's bytes;
pool records and ids past the slots keep their addresses."""

import pytest
import torch

from moestream.experts.grouping import HostStaging
from moestream.kernels import reference

STRIDE, EXPERTS = 4096 + 192, 24


def test_the_reference_plan_takes_each_distinct_host_id_once():
    table = torch.tensor([100, 5000, 5100, 200, 5200], dtype=torch.int64)  # host range [5000, 6000)
    ids = torch.tensor([2, 1, 2, 0, 4, 1])
    staged, sources = reference.stage_plan(table, ids, 5000, 6000, 9000, 10, capacity=2)
    assert staged.tolist() == [100, 9010, 9000, 200, 5200]  # id 4: no slot left, read in place
    assert sources.tolist() == [5100, 5000]


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [4, 16])
def test_staged_slots_hold_the_records_the_plan_names(capacity):
    from moestream.kernels.staging import stage_host_records

    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (EXPERTS, STRIDE), dtype=torch.uint8, generator=gen).pin_memory()
    pool = torch.randint(0, 256, (EXPERTS, STRIDE), dtype=torch.uint8, generator=gen).cuda()
    slots = torch.zeros(capacity, STRIDE, dtype=torch.uint8, device="cuda")
    on_host = torch.rand(EXPERTS, generator=gen) < 0.6
    table = torch.tensor([(host if h else pool)[e].data_ptr() for e, h in enumerate(on_host.tolist())],
                         dtype=torch.int64)
    ids = torch.randint(0, EXPERTS, (40,), generator=gen)
    staging = HostStaging(host.data_ptr(), host.data_ptr() + host.numel(), slots, STRIDE,
                          torch.full((EXPERTS,), -1, dtype=torch.int64, device="cuda"),
                          torch.empty(capacity, dtype=torch.int64, device="cuda"))
    got = stage_host_records(table.cuda(), ids.cuda(), staging).cpu()
    want, sources = reference.stage_plan(table, ids, staging.host_base, staging.host_end, slots.data_ptr(),
                                         STRIDE, capacity)
    touched = ids.unique()
    assert torch.equal(got[touched], want[touched])
    assert torch.equal(staging.sources.cpu(), sources)
    for e in touched.tolist():
        rank = (int(got[e]) - slots.data_ptr()) // STRIDE
        if 0 <= rank < capacity:
            assert torch.equal(slots[rank].cpu(), host[e])
    assert int((sources != 0).sum()) == min(capacity, int(on_host[touched].sum()))
