"""Q3/Q2 records derived from Q4 hold exactly q4 >> 1 / q4 >> 2 (read back with an independent numpy unpacker),
keep their scales and biases, and dequantize at the bin midpoints."""

from collections import Counter

import numpy as np
import pytest
import torch

from moestream.engine.llm import LLM
from moestream.experts.format import RecordLayout
from moestream.experts.provider import ExpertStep
from moestream.packer.pack import PackOptions, pack
from moestream.quant.lowbit import dequantize_lowbit
from tests.engine.runs import greedy_trace, prompt_of
from tests.packer.helpers import load_manifest, read_record


def numpy_codes(words: torch.Tensor, bits: int) -> np.ndarray:
    """Little-endian bit stream of int32 words -> codes of `bits` bits (independent of moestream)."""
    raw = words.numpy().astype("<i4").view(np.uint8)
    stream = np.unpackbits(raw, axis=-1, bitorder="little").reshape(words.shape[0], -1, bits)
    return (stream * (1 << np.arange(bits))).sum(-1)


@pytest.fixture(scope="module")
def lowbit_store(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lowbit") / "store")
    pack(tiny.checkpoint("qwen3_moe"), out, PackOptions(precisions=("q4", "q3", "q2"), show_progress=False))
    return out


@pytest.mark.parametrize("precision,bits", [("q3", 3), ("q2", 2)])
def test_records_are_shifted_q4(lowbit_store, precision, bits):
    m = load_manifest(lowbit_store)
    assert m.layouts[precision].record_bytes < m.layouts["q4"].record_bytes
    for rid in (0, 5, m.geometry.num_records - 1):
        q4, low = read_record(lowbit_store, "q4", rid), read_record(lowbit_store, precision, rid)
        for p in ("gate", "up", "down"):
            want = numpy_codes(q4[f"{p}_w"], 4) >> (4 - bits)
            got = numpy_codes(low[f"{p}_w"], 2)  # Q3's low two bits, or all of Q2
            if bits == 3:
                got = got | (numpy_codes(low[f"{p}_h"], 1) << 2)
            assert np.array_equal(got, want), (rid, p)
            assert torch.equal(low[f"{p}_s"], q4[f"{p}_s"]) and torch.equal(low[f"{p}_b"], q4[f"{p}_b"])


def test_midpoint_reconstruction():
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)]], dtype=torch.int32)
    from moestream.quant.lowbit import derive_codes

    s, b = torch.ones(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)
    words = words.repeat(1, 4)  # 64 codes: one group
    w2 = dequantize_lowbit(derive_codes(words, 2), s, b, 2)
    w3 = dequantize_lowbit(derive_codes(words, 3), s, b, 3)
    q4 = torch.arange(16).repeat(4).float()
    assert torch.equal(w2[0], (q4 // 4) * 4 + 1.5) and torch.equal(w3[0], (q4 // 2) * 2 + 0.5)


@pytest.mark.parametrize("experts", [3, 2])
def test_invariance_within_each_mode(lowbit_store, experts):
    stride = RecordLayout.build(f"q{experts}", 64, 64).stride
    reference = None
    for pool_gb, ring in ((None, 64), (2.0001 * stride / 1e9, 8), (16.0001 * stride / 1e9, 4)):
        llm = LLM(lowbit_store, device="cpu", experts=experts, pool_gb=pool_gb, ring_slots=ring, ring_group=2)
        try:
            trace = greedy_trace(llm, prompt_of(llm, 40), 12)
        finally:
            llm.close()
        if reference is None:
            reference = trace
        assert trace[0] == reference[0] and torch.equal(trace[1], reference[1])


def test_missing_variant_is_built_on_first_use(tiny, tmp_path):
    import shutil

    from moestream.experts.store import open_store

    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen2_moe", experts=("q4",)), store)
    llm = LLM(str(store), device="cpu", experts=2)
    llm.close()
    assert (store / "experts.q2.bin").is_file()
    assert "q2" in open_store(str(store), verify=True).manifest.layouts


def test_mixed_mode_reports_each_precision(lowbit_store):
    stride = RecordLayout.build("q4", 64, 64).stride
    llm = LLM(lowbit_store, device="cpu", experts=4, miss_experts=2, pool_gb=16.0001 * stride / 1e9, ring_slots=8,
              ring_group=2)
    try:
        from moestream.sampling import SamplingParams

        llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=12))
        snap = llm.stats()
        totals = snap["totals"]
        assert totals["q2"]["reads"]["disk"]["records"] > 0 and totals["q4"]["reads"]["disk"]["records"] > 0
        for precision, layout_stride in (("q4", stride), ("q2", RecordLayout.build("q2", 64, 64).stride)):
            for tier in ("disk", "gpu"):
                r = totals[precision]["reads"][tier]
                assert r["bytes"] == r["records"] * layout_stride
        # A record fetched at 2 bits on a demand miss stays a 2-bit resident: the next step hits it as it is.
        provider = llm.provider
        absent = [e for e in range(8) if provider.geometry.rid(1, e) not in provider.pool.slot_of][:2]
        ids, x = torch.tensor([absent]), torch.randn(1, 64)
        list(provider.parts(1, ids, x, ExpertStep()))
        slots = [provider.pool.slot_of[provider.geometry.rid(1, e)] for e in absent]
        fetched = [provider.pool.pending[s] for s in slots]
        hits = totals["q2"]["hits"] if "q2" in totals else 0
        batches = list(provider.parts(1, ids, x, ExpertStep()))
        assert [provider.pool.precision_of[s] for s in slots] == ["q2", "q2"]
        assert [provider.pool.pending[s] for s in slots] == fetched  # hit, not fetched again
        assert [b.layout.precision for b in batches] == ["q2"]
        assert llm.stats()["totals"]["q2"]["hits"] == hits + 2
    finally:
        llm.close()


def test_mixed_mode_host_tier_holds_the_miss_precision_first(lowbit_store):
    """With a host tier that holds the model, mixed mode preloads it at the miss precision, then Q4 records in
    the slots left; fills and lookahead take Q4 from RAM where it is, else the miss precision: nothing waits on
    the disk after loading."""
    stride = RecordLayout.build("q4", 64, 64).stride
    llm = LLM(lowbit_store, device="cpu", experts=4, miss_experts=2, pool_gb=16.0001 * stride / 1e9,
              host_gb=40.0001 * stride / 1e9, preload=True, ring_slots=8, ring_group=2)
    try:
        from moestream.sampling import SamplingParams

        records, keys = llm.provider.geometry.num_records, set(llm.provider.residency.host.slot_of)
        assert {("q2", rid) for rid in range(records)} <= keys and len(keys) == 40
        llm.generate([prompt_of(llm, 40)], SamplingParams(max_tokens=12))
        totals = llm.stats()["totals"]
        assert totals["q2"]["reads"]["host"]["records"] > 0 and totals["q4"]["reads"]["host"]["records"] > 0
        assert totals["q2"]["reads"]["disk"]["records"] == records  # the preload's reads alone
        assert totals["q4"]["reads"]["disk"]["records"] == 40 - records
    finally:
        llm.close()


def test_mixed_mode_steps_read_by_address_are_counted_per_precision(lowbit_store):
    """A graph step in mixed mode reads each cached record at its own precision and a miss at the miss one from
    the host tier; its counts say so, as the host path's do."""
    q4, q2 = (RecordLayout.build(p, 64, 64).stride for p in ("q4", "q2"))
    llm = LLM(lowbit_store, device="cpu", experts=4, miss_experts=2, pool_gb=16.0001 * q4 / 1e9,
              host_gb=40.0001 * q4 / 1e9, preload=True, ring_slots=8, ring_group=2)
    try:
        from moestream.sampling import SamplingParams

        # a short prompt and no decode step: its misses leave some preloaded Q4 slots (a longer run may evict all)
        llm.generate([prompt_of(llm, 8)], SamplingParams(max_tokens=1))
        provider, before = llm.provider, llm.stats()["totals"]
        g, pool = provider.geometry, provider.pool
        precision = {rid: pool.precision_of[slot] for rid, slot in pool.slot_of.items()}
        assert set(precision.values()) == {"q4", "q2"}  # fills at Q4, demand misses kept at 2 bits
        routed = torch.tensor([list(range(llm.config.num_experts_per_tok))] * g.num_layers)
        used = [g.rid(layer, e) for layer in range(g.num_layers) for e in routed[0].tolist()]
        cached = Counter(precision.get(rid, "miss") for rid in used)
        provider.note_addressed(routed)
        after = llm.stats()["totals"]

        def grew(*keys):  # a counter's growth; a precision absent before counted 0
            def at(totals):
                for k in keys:
                    totals = totals.get(k, {})
                return totals or 0
            return at(after) - at(before)

        assert grew("q4", "hits") == cached["q4"] and grew("q2", "hits") == cached["q2"]
        assert grew("q4", "misses") == cached["miss"] and grew("q4", "lookups") == cached["q4"] + cached["miss"]
        assert grew("q2", "reads", "host", "records") == cached["miss"]
        assert grew("q2", "reads", "host", "bytes") == cached["miss"] * q2
        assert grew("q2", "reads", "gpu", "bytes") == cached["q2"] * q2
    finally:
        llm.close()


@pytest.mark.gpu
def test_gpu_mixed_mode_decode_runs_as_graphs(lowbit_store):
    """Mixed mode with a host tier holding every record at the miss precision: decode steps are CUDA graphs
    (each precision's kernels skip the other's entries), and they give the bits of the same step run eagerly."""
    stride = RecordLayout.build("q4", 64, 64).stride
    traces = []
    for mode in ("graph", "eager"):
        llm = LLM(lowbit_store, device="cuda", dtype="bfloat16", experts=4, miss_experts=2,
                  pool_gb=16.0001 * stride / 1e9, host_gb=40.0001 * stride / 1e9, preload=True, decode_mode=mode)
        try:
            traces.append(greedy_trace(llm, prompt_of(llm, 40), 12))
            replays = llm.decoder.graph_replays
        finally:
            llm.close()
        assert (replays > 0) == (mode == "graph")
    assert traces[0][0] == traces[1][0] and torch.equal(traces[0][1], traces[1][1])
