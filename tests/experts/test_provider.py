"""The streaming provider's counters add up, and its failures are clear and bounded in time."""

import os
import shutil
from collections import Counter

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.errors import BudgetError, StoreError
from moestream.experts.format import RecordLayout
from moestream.experts.provider import ExpertStep
from moestream.sampling import SamplingParams
from tests.engine.runs import prompt_of

STRIDE = RecordLayout.build("q4", 64, 64).stride


def _check_totals(totals: dict) -> None:
    assert totals["hits"] + totals["misses"] == totals["lookups"]
    for tier, r in totals["reads"].items():
        assert r["bytes"] == r["records"] * STRIDE, tier
    assert totals["reads"]["gpu"]["records"] == totals["hits"]
    assert totals["reads"]["host"]["records"] + totals["reads"]["disk"]["records"] >= totals["misses"]


@pytest.mark.parametrize("host_gb", [0.0, 0.01])
def test_counters_add_up(tiny, host_gb):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=6 * STRIDE / 1e9, host_gb=host_gb)
    try:
        llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=12))
        llm.generate([prompt_of(llm, 5, seed=1)], SamplingParams(max_tokens=12))
        snap = llm.stats()
        totals = snap["totals"]["q4"]
        _check_totals(totals)
        for layer in snap["layers"]:
            _check_totals(layer["q4"])
        assert totals["prefetch_issued"] > 0 and 0 <= totals["prefetch_used"] <= totals["prefetch_issued"]
        assert totals["prefill_steps"] > 0 and totals["decode_steps"] > 0
        if host_gb:
            assert totals["reads"]["host"]["records"] > 0
    finally:
        llm.close()


def test_whole_model_pool_reads_nothing_the_second_time(tiny):
    llm = LLM(tiny.store("qwen2_moe"), device="cpu")
    try:
        prompt = prompt_of(llm, 40)
        first = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
        second = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
        assert first.token_ids == second.token_ids
        assert first.stats["experts"]["q4"]["reads"]["disk"]["records"] > 0
        assert second.stats["experts"]["q4"]["reads"]["disk"]["records"] == 0
        assert second.stats["experts"]["q4"]["misses"] == 0
    finally:
        llm.close()


def test_pool_below_one_step_is_refused_at_load(tiny):
    with pytest.raises(BudgetError, match="one decode step needs at least 2"):
        LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=STRIDE / 1e9)


def test_store_file_short_mid_run_is_a_clear_error(tiny, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    llm = LLM(str(store), device="cpu", pool_gb=2.0001 * STRIDE / 1e9, io_timeout_s=5)
    try:
        os.truncate(store / "experts.q4.bin", STRIDE * 3)  # the store shrinks after it was checked
        with pytest.raises(StoreError, match="experts.q4.bin is shorter than its manifest says"):
            llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=4))
    finally:
        llm.close()


def test_fake_reads_keep_slots_but_skip_io(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=4 * STRIDE / 1e9, fake_reads=True)
    try:
        llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=4))
        totals = llm.stats()["totals"]["q4"]
        assert totals["misses"] > 0 and totals["read_seconds"] == 0
    finally:
        llm.close()


def test_direct_io_is_reported(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        assert llm.stats()["direct_io"] in (True, False)
        assert llm.stats()["direct_io"] or llm.provider.io_note
    finally:
        llm.close()


def test_steps_read_by_address_are_counted(tiny):
    """A CUDA-graph step bypasses the provider; the decoder hands it the step's expert ids to count later."""
    import torch

    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=6 * STRIDE / 1e9, host_gb=0.01)
    try:
        llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=4))
        g, before = llm.provider.geometry, llm.stats()["totals"]["q4"]
        routed = torch.tensor([[0, 1, 1, 2][: llm.config.num_experts_per_tok]] * g.num_layers)
        distinct = g.num_layers * len(set(routed[0].tolist()))
        resident = sum(g.rid(layer, e) in llm.provider.pool.slot_of for layer in range(g.num_layers)
                       for e in set(routed[0].tolist()))
        assert 0 < resident < distinct  # some hits and some misses
        for _ in range(2):  # two steps, counted together when the counters are read
            llm.provider.note_addressed(routed)
        after = llm.stats()["totals"]["q4"]
        _check_totals(after)
        assert after["lookups"] - before["lookups"] == 2 * distinct
        assert after["hits"] - before["hits"] == 2 * resident
        assert after["reads"]["host"]["records"] - before["reads"]["host"]["records"] == 2 * (distinct - resident)
        assert after["decode_steps"] - before["decode_steps"] == 2 * g.num_layers
    finally:
        llm.close()


def test_a_request_counts_its_own_steps_read_by_address(tiny):
    """Steps noted before a request belong to the earlier request, not to the next one's counts."""
    import torch

    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=6 * STRIDE / 1e9, host_gb=0.01)
    try:
        layers, params = llm.provider.geometry.num_layers, SamplingParams(max_tokens=4, ignore_eos=True)
        first = llm.generate([prompt_of(llm, 8)], params)[0].stats["experts"]["q4"]["decode_steps"]
        routed = torch.zeros(layers, llm.config.num_experts_per_tok, dtype=torch.long)
        llm.provider.note_addressed(routed)  # a graph step of an earlier request, not counted yet
        again = llm.generate([prompt_of(llm, 8)], params)[0].stats["experts"]["q4"]["decode_steps"]
        assert again == first
        before = llm.provider.totals()["q4"]["decode_steps"]
        llm.provider.note_addressed(routed)
        assert llm.provider.totals()["q4"]["decode_steps"] == before + layers  # counted when read
    finally:
        llm.close()


def test_prefill_keeps_each_layers_share_across_requests(tiny):
    """A prefill's pool fills take its own layer's idle slots, so the next layers keep their residents: a
    second long prompt finds each layer's share still in the pool."""
    store = tiny.store("qwen3_moe")
    llm = LLM(store, device="cpu", pool_gb=8 * STRIDE / 1e9)  # 2 of 8 experts per layer
    try:
        layers = llm.provider.geometry.num_layers
        share = llm.provider.pool.num_slots // layers
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([prompt_of(llm, 48)], params)
        second = llm.generate([prompt_of(llm, 48, seed=1)], params)[0].stats["experts"]["q4"]
        assert second["prefill_steps"] == layers
        assert second["hits"] >= layers * share - 1
    finally:
        llm.close()


def test_preload_puts_every_record_where_it_stays(tiny):
    """Preloading fills the pool (or the host tier) with every record, so a request misses nothing."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", preload=True)
    try:
        assert llm.provider.pool.resident == llm.provider.geometry.num_records
        out = llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=4))[0].stats["experts"]["q4"]
        assert out["misses"] == 0 and out["reads"]["disk"]["records"] == 0
    finally:
        llm.close()
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", preload=True, pool_gb=2 * STRIDE / 1e9, host_gb=0.01)
    try:
        assert len(llm.provider.residency.host.slot_of) == llm.provider.geometry.num_records
    finally:
        llm.close()


@pytest.mark.gpu
def test_gpu_a_placed_prefill_counts_what_the_hosts_grouping_counts(tiny, monkeypatch):
    """With every record in the pool, a prefill step groups its entries on the device (PlacedExperts) and is counted
    later, as the host's grouping (which a routing trace needs) counts it, with the same logits."""
    from moestream.kernels import ops

    kinds, expert_part = Counter(), ops.expert_part
    monkeypatch.setattr(ops, "expert_part", lambda x, part, *a: (kinds.update([type(part).__name__]),
                                                                 expert_part(x, part, *a)))
    runs = []
    for trace in (False, True):
        llm = LLM(tiny.store("qwen3_moe"), device="cuda", dtype="bfloat16", warm=False)
        try:
            if trace:
                llm.provider.trace([])
            kinds.clear()
            out = llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
            runs.append((dict(kinds), out.prompt_logprobs, llm.stats()))
        finally:
            llm.close()
    (placed, logprobs, stats), (host, host_logprobs, host_stats) = runs
    assert set(placed) == {"PlacedExperts"} and "PlacedExperts" not in host  # a graph's capture runs it twice
    assert logprobs == host_logprobs
    keys = ("lookups", "hits", "misses", "reads", "prefill_steps")
    assert {k: stats["totals"]["q4"][k] for k in keys} == {k: host_stats["totals"]["q4"][k] for k in keys}
    assert [e["uses"] for e in stats["experts"]] == [e["uses"] for e in host_stats["experts"]]


def test_prefill_fills_never_leave_another_layer_short(tiny):
    """A decode leaves the pool uneven across layers; a prefill's fills then take free slots and those of layers
    above their share, never a layer's last `share` records (which its own prefill step would fetch again)."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=8 * STRIDE / 1e9)  # 2 of 8 experts per layer
    try:
        p = llm.provider
        n, share = p.geometry.num_experts, p.pool.num_slots // p.geometry.num_layers
        # least recently used first: layer 1 holds one record, layer 2 two (its share), layer 0 five, layer 3 none
        for rid in [p.geometry.rid(1, 0), p.geometry.rid(2, 0), p.geometry.rid(2, 1)] + [p.geometry.rid(0, e)
                                                                                           for e in range(5)]:
            p.pool.allocate(rid)
        ids = torch.arange(64).remainder(n).view(32, 2)  # every expert, 8 entries each
        list(p.parts(3, ids, torch.randn(32, 64), ExpertStep()))
        held = Counter(rid // n for rid in p.pool.slot_of)
        assert held[3] == share and held[2] == share and held[1] == 1 and held[0] == 5 - share
    finally:
        llm.close()


def test_steps_read_by_address_count_the_trunk_layers_of_a_store_with_an_mtp_layer(tmp_path):
    """A store keeps the MTP layer's experts as one more record layer, which decode steps never route to."""
    from benchmarks.synthetic import build

    build(str(tmp_path / "s"), "qwen3-30b", layers=2, vocab_size=320, hidden_size=64, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
          mtp=True)
    llm = LLM(str(tmp_path / "s"), device="cpu")
    try:
        assert llm.provider.geometry.num_layers == 3
        residency = llm.provider.residency
        residency.note_addressed(torch.tensor([[0, 3], [5, 5]]))  # one step over the two trunk layers
        residency.flush()
        layers = llm.stats()["layers"]
        assert [sum(c["lookups"] for c in per.values()) for per in layers] == [2, 1, 0]
    finally:
        llm.close()
