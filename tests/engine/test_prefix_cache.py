"""The prefix cache: a restored prefix gives exactly the uncached output, for every model type."""

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.engine.prefix_cache import PrefixCache, block_keys
from moestream.engine.stream import TextStream
from moestream.sampling import SamplingParams
from tests.conftest import MODEL_TYPES

CHUNK = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; spinning OpenMP threads only hurt on a shared machine
    yield
    torch.set_num_threads(before)


def run(llm: LLM, ids: list[int]) -> tuple[list[int], int]:
    out = llm.generate([ids], GREEDY)[0]
    return out.token_ids, out.stats["timings"]["cached_tokens"]


def assert_cached_runs_equal_plain_runs(plain: LLM, cached: LLM) -> None:
    a = list(range(3, 43))  # 40 tokens: boundaries at 8, 16, 24, 32, 40
    b = a[:30] + list(range(100, 110))  # shares 30 tokens with a
    # (prompt, prefill tokens restored): the deepest cached boundary, leaving one token to compute
    cases = [(a, 0), (b, 24), (a, 32), (a[:32], 24), (a[:33], 32), (b + [7], 40), (list(range(50, 60)), 0)]
    for ids, restored in cases:
        want, _ = run(plain, ids)
        assert run(cached, ids) == (want, restored), ids
    stats = cached.prefix_cache.stats()
    assert (stats["hits"], stats["misses"]) == (5, 2)
    assert stats["cached_tokens"] == 24 + 32 + 24 + 32 + 40


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_restored_prefixes_give_the_uncached_output(tiny, model_type):
    store = tiny.store(model_type)
    plain = LLM(store, device="cpu", prefill_chunk=CHUNK)
    cached = LLM(store, device="cpu", prefill_chunk=CHUNK, prefix_cache_mb=10)
    assert_cached_runs_equal_plain_runs(plain, cached)
    plain.close()
    cached.close()


@pytest.mark.gpu
@pytest.mark.parametrize("max_context", [8192, 16])  # 16: the CUDA decoder grows its KV buffers mid-run
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_restored_prefixes_give_the_uncached_output_on_cuda(tiny, model_type, max_context):
    store = tiny.store(model_type)
    plain = LLM(store, device="cuda", prefill_chunk=CHUNK, max_context=max_context)
    cached = LLM(store, device="cuda", prefill_chunk=CHUNK, max_context=max_context, prefix_cache_mb=10)
    assert_cached_runs_equal_plain_runs(plain, cached)
    plain.close()
    cached.close()


def test_restored_attention_caches_keep_their_capacity(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=CHUNK, prefix_cache_mb=10, max_batch=1)  # eager
    ids = list(range(3, 103))
    request = llm._submit(ids, GREEDY)
    list(llm._steps(request))
    seq = request.generation.seq
    capacities = [c.capacity for c in seq.state.caches]
    state = llm.model.new_state(llm.dtype, llm.device)
    boundary = llm.prefix_cache.restore(ids + [5], state)
    assert boundary == 96 and state.length == 96 and state.tokens == ids[:96]
    assert [c.capacity for c in state.caches] == capacities  # as after an uncached prefill of 96 tokens
    assert all(torch.equal(s.snapshot().k, r.snapshot().k[:96]) for s, r in zip(state.caches, seq.state.caches))
    llm.close()


def test_a_hit_starts_from_the_cached_kv_blocks_and_copies_only_a_partly_filled_one(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=24, prefix_cache_mb=10)
    try:
        pool, ids = llm.decoder.kv, list(range(3, 53))  # boundaries at 24 and 48: blocks of 16 positions
        run(llm, ids)
        entries = list(llm.prefix_cache.entries.values())
        assert [len(e.blocks) for e in entries] == [2, 3] and pool.used == 3  # the second holds the first's two
        request = llm._submit(ids[:48] + [7, 8], GREEDY)
        llm.step()  # restored at 48 (a full block boundary): its first three blocks are the cache's
        table = request.generation.seq.state.caches[0].table
        assert table.blocks[:3] == entries[1].blocks and all(pool.holders[b] >= 2 for b in table.blocks[:3])
        list(llm._steps(request))
        request = llm._submit(ids[:24] + [9], GREEDY)
        llm.step()  # restored at 24: block 0 shared, block 1 (positions 16..23 of 32) its own copy
        table = request.generation.seq.state.caches[0].table
        assert table.blocks[0] == entries[0].blocks[0] and table.blocks[1] not in entries[0].blocks
        list(llm._steps(request))
        llm.prefix_cache.clear()
        assert pool.used == 0
    finally:
        llm.close()


def test_a_bounded_kv_cache_takes_blocks_back_from_cached_prefixes(tiny):
    store = tiny.store("qwen3_moe")
    plain = LLM(store, device="cpu", prefill_chunk=CHUNK)
    llm = LLM(store, device="cpu", prefill_chunk=CHUNK, prefix_cache_mb=10, kv_tokens=64)  # 4 blocks
    try:
        for start in (3, 100, 200):  # each 40-token prompt leaves 3 blocks cached; the next needs 3 of 4
            ids = list(range(start, start + 40))
            assert run(llm, ids) == (run(plain, ids)[0], 0)
        stats = llm.prefix_cache.stats()
        assert stats["evictions"] > 0 and stats["kv_blocks"] <= 4
    finally:
        plain.close()
        llm.close()


def test_lru_stays_within_the_byte_budget(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=CHUNK, prefix_cache_mb=10)
    assert llm.prefix_cache.stats()["bytes"] == 0
    run(llm, list(range(3, 20)))  # snapshots at 8 and 16
    sizes = llm.prefix_cache.stats()["bytes"]
    assert sizes > 0
    small = PrefixCache(budget_bytes=sizes, chunk=CHUNK, pool=llm.decoder.kv)  # the two share one KV block
    llm.prefix_cache = small
    run(llm, list(range(3, 20)))
    run(llm, list(range(30, 47)))  # two more snapshots: the first two go
    s = small.stats()
    assert s["bytes"] <= sizes and s["entries"] == 2 and s["evictions"] == 2
    assert run(llm, list(range(30, 47)))[1] == 16 and run(llm, list(range(3, 20)))[1] == 0
    llm.close()


def test_block_keys_chain_the_whole_prefix():
    a, b = list(range(32)), list(range(32))
    b[3] = 99  # differs in the first block only
    ka, kb = block_keys(a, 8, 4), block_keys(b, 8, 4)
    assert ka[0] != kb[0] and all(x != y for x, y in zip(ka[1:], kb[1:]))
    assert block_keys(a, 8, 2) == ka[:2]


def test_text_stream_holds_back_stop_strings_and_can_be_cancelled(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    ids = llm.tokenizer.encode("The expert pool holds")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    full = llm.generate([ids], params)[0].text
    start = next(i for i in range(1, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].isprintable())
    stop = full[start:start + 3]  # several byte tokens: the stream sees its start before knowing it is one
    stream = TextStream(llm, ids, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))
    pieces = list(stream)
    assert "".join(pieces) == stream.output().text == full[: full.find(stop)]
    assert stream.finish_reason == "stop"
    stream = TextStream(llm, ids, params, cancelled=lambda: len(stream.tokens) >= 3)
    list(stream)
    assert (len(stream.tokens), stream.finish_reason) == (3, "cancelled")
    llm.close()
