"""A whole-GPU budget split into parts, the pool getting what is left; budgets that cannot hold a step refused."""

import dataclasses
import gc
import weakref

import pytest
import torch

from moestream.config import EngineConfig
from moestream.engine.llm import LLM
from moestream.engine.loader import load_model
from moestream.engine.memory import activation_bytes, kv_row_bytes, slot_bytes
from moestream.errors import BudgetError, ConfigError
from moestream.experts.store import open_store
from moestream.layers.linear import Projections
from moestream.sampling import SamplingParams


def _kv_bytes(llm: LLM) -> int:
    """The paged KV pool's bytes: its positions times a position's keys and values in every attention layer."""
    return llm.engine_config.kv_limit * kv_row_bytes(llm.model.new_state(llm.dtype, torch.device("meta")))


def test_the_pool_gets_what_the_other_parts_leave(tiny):
    llm = LLM(tiny.store("qwen4_exp"), device="cpu", gpu_gb=0.7)
    try:
        plan, memory = llm.gpu_plan, llm.stats()["memory"]
        assert plan.dense + plan.state + plan.activations + plan.ring + plan.pool == 0.7e9
        stride, records = llm.provider.pool.stride, llm.provider.geometry.num_records
        assert 0 <= min(plan.pool // stride, records) * stride - memory["pool"] <= stride  # capped at the model
        assert memory["dense"] == plan.dense and memory["ngram_tables"] == 0 and memory["budget"] == 0.7e9
        one, kv = slot_bytes(llm.model, llm.dtype, llm.engine_config), _kv_bytes(llm)
        assert plan.state == llm.engine_config.max_batch * one + kv and one > 0 and kv > 0  # a state per slot
        assert memory["decode_state"] == one + kv  # the slots are made as sequences need them, the KV pool at load
        assert memory["kv_cache"]["blocks"] * 16 == 2 * llm.engine_config.max_context  # the default under a budget
        assert plan.activations == activation_bytes(llm.config, llm.engine_config.prefill_chunk, llm.dtype)
    finally:
        llm.close()


def test_the_plan_counts_the_verify_steps_row_copies(tiny):
    llm = LLM(tiny.store("qwen4_exp"), device="cpu", gpu_gb=0.7, speculation="lookup", ngram_tier="host")
    try:
        model, dtype = llm.model, llm.dtype
        state = model.new_state(dtype, llm.device)
        state.reserve_rows(5)
        copies = 0
        for s in state.layers:  # DeltaNet layers, and PLE layers' two states
            for part in (s, getattr(s, "mixer", None), getattr(s, "ple", None)):
                copies += part.rows.bytes() if getattr(part, "rows", None) is not None else 0
        kv = _kv_bytes(llm)
        one = (llm.gpu_plan.state - kv) // llm.max_batch  # a decode state per batch slot, beside the KV pool
        assert one == slot_bytes(model, dtype, llm.engine_config)
        assert one - slot_bytes(model, dtype, dataclasses.replace(llm.engine_config, speculation="off")) == copies > 0
        assert llm.stats()["memory"]["decode_state"] == one + kv  # one slot made so far
    finally:
        llm.close()


@pytest.mark.parametrize("options, message", [
    (dict(gpu_gb=0.3), r"is below the \d+\.\d\d GB this model needs"),
    (dict(gpu_gb=0.7, pool_gb=0.5), "does not fit"),
    (dict(gpu_gb=2.0, pool_gb=1e-6), "--pool-gb 1e-06 is below one decode step's experts"),
])
def test_a_budget_that_cannot_hold_a_step_is_refused_in_one_line(tiny, options, message):
    with pytest.raises(BudgetError, match=message) as e:
        LLM(tiny.store("qwen4_exp"), device="cpu", **options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), 0, -1])
def test_gpu_gb_must_be_a_positive_number(value):
    with pytest.raises(ConfigError, match="--gpu-gb"):
        EngineConfig(gpu_gb=value)


@pytest.mark.gpu
def test_gpu_the_load_stays_within_its_budget(tiny):
    llm = LLM(tiny.store("qwen4_exp"), device="cuda", gpu_gb=1.0)
    try:
        memory = llm.stats()["memory"]
        assert 0 < memory["peak_allocated"] <= 1e9
        one = slot_bytes(llm.model, llm.dtype, llm.engine_config)
        assert memory["decode_state"] == llm.gpu_plan.state - (llm.max_batch - 1) * one  # the plan holds every
        # batch slot's and the KV pool; the load makes the first slot's, the others as sequences take them
    finally:
        llm.close()


@pytest.mark.gpu
def test_gpu_the_load_keeps_one_copy_of_the_weights(tiny):
    """Fusing projections at load frees their unfused copies (autograd's graph once held them all: 4.7 GB above
    the flagship's GPU plan, which refused every budgeted row)."""
    store = open_store(tiny.store("qwen4_exp"))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_model(store, torch.device("cuda"), torch.bfloat16)
    blocks = {t.untyped_storage().data_ptr(): -(-t.untyped_storage().nbytes() // 512) * 512
              for t in [*model.parameters(), *model.buffers()] if t.is_cuda}.values()
    groups = [p.weight for m in model.modules() for p in vars(m).values() if isinstance(p, Projections)]
    largest = max(g.numel() * g.element_size() for g in groups)
    small = 2**16  # the n-gram tables' counters and staging
    assert torch.cuda.max_memory_allocated() - before <= sum(blocks) + largest + small  # in 512-byte blocks


def test_close_lets_go_of_the_pool_and_the_host_tier(tiny):
    """Once closed, nothing of an engine holds its expert provider (pool, pinned host tier, fetch threads), even
    while the closed engine is still referenced: the next engine in the process can pin that memory again."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", host_gb=0.05)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    provider, model = weakref.ref(llm.provider), weakref.ref(llm.model)
    llm.close()
    gc.collect()
    assert provider() is None and model() is None
