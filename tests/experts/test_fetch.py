"""Host-tier copies into adjacent slots go out as one copy, and every slot still holds the record its batch
names."""

import torch

from moestream.engine.llm import LLM
from moestream.experts.format import RecordLayout
from moestream.experts.provider import ExpertStep

STRIDE = RecordLayout.build("q4", 64, 64).stride


def test_adjacent_host_tier_copies_merge_and_land_where_asked(tiny):
    store = tiny.store("qwen3_moe")
    llm = LLM(store, device="cpu", pool_gb=2.0001 * STRIDE / 1e9, host_gb=1.0, preload=True)
    try:
        provider, spans = llm.provider, []
        flush = provider.residency.fetcher._flush
        provider.residency.fetcher._flush = lambda span: (spans.append(span[2]) if span else None, flush(span))
        every = torch.arange(96).remainder(8).reshape(48, 2)  # every expert: the ring fetches them all
        records = open(f"{store}/experts.q4.bin", "rb").read()
        for b in provider.parts(0, every, torch.zeros(48, 64), ExpertStep()):
            for e, slot in zip(b.experts, b.slots):
                rid = provider.geometry.rid(0, e)
                assert bytes(b.buffer[slot].numpy()) == records[rid * STRIDE:(rid + 1) * STRIDE], (e, slot)
        assert max(spans) > 1, spans  # consecutive experts into consecutive ring slots: one copy
    finally:
        llm.close()


def test_host_tier_counts_the_records_it_replaces():
    """Graph mode keeps addresses of host slots; a slot given to another record must be noticed."""
    from moestream.experts.host import HostTier

    tier = HostTier(2, 64, pinned=False)
    tier.allocate(("q4", 0))
    tier.allocate(("q4", 1))
    assert tier.evictions == 0
    tier.allocate(("q4", 2))  # takes record 0's slot
    assert tier.evictions == 1 and ("q4", 0) not in tier.slot_of
