"""A decode step in pieces (experts/pieces.py): the host's turn after a layer's routing brings each routed record into
a pool slot, counts the lookups as a decode step does, and writes the slot's address where the expert kernels read
it. The pieces themselves are CUDA graphs (tests/engine/test_invariance_gpu.py holds them to the eager bits)."""

import os

import torch

from moestream.engine.llm import LLM
from moestream.experts.format import RecordLayout, experts_file
from moestream.experts.pieces import PieceTable

STRIDE = RecordLayout.build("q4", 64, 64).stride


def test_a_layers_routed_records_land_in_pool_slots_whose_addresses_the_table_holds(tiny):
    store = tiny.store("qwen3_moe")
    llm = LLM(store, device="cpu", pool_gb=6 * STRIDE / 1e9)
    try:
        res = llm.provider.residency
        pool, layer = res.pool, 1
        table = PieceTable(llm.provider.decode)
        before = res.stats.at(layer, "q4").lookups
        for routed in ([3, 1, 3, 0], [1, 2, 1, 3]):  # two rows of top-2 each: a repeated expert is one lookup
            table.resolve(layer, torch.tensor(routed), torch.zeros(2, llm.config.hidden_size))
            table.settle()
            for e in set(routed):
                rid = res.geometry.rid(layer, e)
                slot = pool.slot_of[rid]
                assert table.addresses[layer, e].item() == pool.buffer.data_ptr() + slot * pool.stride
                with open(os.path.join(store, experts_file("q4")), "rb") as f:
                    f.seek(rid * STRIDE)
                    assert bytes(pool.buffer[slot, :STRIDE].tolist()) == f.read(STRIDE)
        assert res.stats.at(layer, "q4").lookups - before == 3 + 3
        for last in range(res.geometry.num_layers):  # every layer's turn, the last one's (nothing after it) too
            table.resolve(last, torch.tensor([0, 1]), torch.zeros(1, llm.config.hidden_size))
            table.settle()
    finally:
        llm.close()


def test_with_no_miss_to_wait_for_the_next_layers_guesses_are_fetched_once_the_next_piece_is_enqueued(tiny):
    """The host's turn keeps the GPU waiting: a prefetch that nothing waits for starts in `settle`, after the
    next piece's replay, unless this layer's misses are being waited for anyway."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        res = llm.provider.residency
        table, geometry = PieceTable(llm.provider.decode), res.geometry
        x = torch.randn(1, llm.config.hidden_size)
        table.resolve(0, torch.tensor([0, 1]), x)
        table.settle()  # layer 0's records were misses: its guesses were fetched with them
        table.resolve(0, torch.tensor([0, 1]), x)
        layer, guesses = table.guesses  # hits only: left for settle
        assert layer == 0 and guesses
        table.settle()
        assert table.guesses is None
        assert all(res.pool.slot_of.get(geometry.rid(1, e)) is not None for e in guesses)
    finally:
        llm.close()


def test_in_mixed_mode_a_miss_is_fetched_low_bit_and_its_precision_written_beside_its_address(tiny):
    store = tiny.store("qwen3_moe", experts=("q4", "q2"))
    llm = LLM(store, device="cpu", pool_gb=6 * STRIDE / 1e9, miss_experts=2)
    try:
        res, layer = llm.provider.residency, 1
        table = PieceTable(llm.provider.decode)
        table.resolve(layer, torch.tensor([3, 1]), torch.zeros(1, llm.config.hidden_size))
        table.settle()
        for e in (3, 1):
            slot = res.pool.slot_of[res.geometry.rid(layer, e)]
            assert res.pool.precision_of[slot] == "q2"
            assert table.bits[layer, e].item() == 2
            assert table.addresses[layer, e].item() == res.pool.buffer.data_ptr() + slot * res.pool.stride
    finally:
        llm.close()
