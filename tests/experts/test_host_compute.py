"""Ring misses computed on the host CPU (--cpu-experts): the same greedy tokens as copying them, logits within
the CPU kernel's rounding, and the cost model's choice."""

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.experts.grouping import Grouping
from moestream.experts.host_compute import HostRates
from tests.engine.runs import greedy_trace, prompt_of
from tests.engine.test_invariance import PROMPT, _record_gb


def _llm(store, **opts) -> LLM:
    """A pool of one decode step and a host tier holding every record: a 48-token prompt streams its misses."""
    return LLM(store, device="cpu", dtype="float32", pool_gb=2 * _record_gb(1) * 1.0001, host_gb=0.01, preload=True,
               **opts)


def _run(store, **opts):
    llm = _llm(store, **opts)
    try:
        tokens, logits = greedy_trace(llm, prompt_of(llm, PROMPT), 8)
        return tokens, logits, llm.stats()["totals"]["q4"]
    finally:
        llm.close()


def test_cpu_computed_misses_keep_the_tokens(tiny):
    store = tiny.store("qwen3_moe")
    tokens, logits, totals = _run(store)
    cpu_tokens, cpu_logits, cpu_totals = _run(store, cpu_experts="all")
    assert cpu_totals["cpu_records"] > 0 and cpu_totals["cpu_entries"] >= cpu_totals["cpu_records"]
    assert totals["cpu_records"] == 0
    assert cpu_totals["reads"]["host"]["records"] < totals["reads"]["host"]["records"]  # not copied as well
    assert cpu_tokens == tokens
    err = (cpu_logits - logits).norm() / logits.norm()
    assert 0 < err < 1e-2  # h rounded to bf16 on the CPU path: its bits are its own


def test_auto_measures_its_rates(tiny):
    llm = _llm(tiny.store("qwen3_moe"), cpu_experts="auto")
    try:
        rates = llm.provider.host_compute.rates
        assert rates.copy_s > 0 and rates.fixed_s + rates.per_row_s > 0
        assert llm.stats()["cpu_experts"]["rates_us"]["copy_s"] > 0
    finally:
        llm.close()


def test_the_cpu_takes_the_least_used_misses_while_it_ends_first(tiny):
    llm = _llm(tiny.store("qwen3_moe"), cpu_experts="auto")
    try:
        compute = llm.provider.host_compute
        compute.rates = HostRates(copy_s=1.0, fixed_s=0.5, per_row_s=0.25)
        rid = llm.provider.geometry.rid
        for e in range(4):  # every record of layer 0 in the host tier
            assert ("q4", rid(0, e)) in compute.res.host.slot_of
        g = Grouping([0, 1, 2, 3], [4, 1, 2, 8], [0, 4, 5, 7, 15], torch.arange(15))
        # misses 0..3: the CPU takes 1 (0.75 s <= 3 copies left), then 2 (0.75 + 1.0 <= 2): 3 would exceed 1 copy
        assert compute.choose(0, g, [None] * 4, set()) == [1, 2]
        assert compute.choose(0, g, [None] * 4, {rid(0, 1)}) == [2]  # 1's record is on its way to the ring
        assert compute.choose(0, g, [None, 5, None, None], set()) == [2]  # 1 is resident: 0 would end last
    finally:
        llm.close()


def test_without_a_host_tier_it_says_why_it_is_off(tiny):
    with pytest.warns(UserWarning, match="--cpu-experts auto is off: no host tier"):
        llm = LLM(tiny.store("qwen3_moe"), device="cpu", dtype="float32", cpu_experts="auto")
    try:
        assert llm.stats()["cpu_experts"]["off_because"] == "no host tier"
    finally:
        llm.close()
