"""The invariance of test_invariance.py on CUDA (bf16): Triton kernels, the ring, graphs and zero-copy."""

import pytest

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams
from tests.engine.runs import greedy_trace, prompt_of, static_hyper_store
from tests.engine.test_invariance import MODEL_TYPES, PROMPT, STEPS, _record_gb

pytestmark = pytest.mark.gpu

SETTINGS = [
    dict(pool_gb=None),  # whole model resident: decode is one CUDA graph
    dict(pool_gb="min"),  # records on disk: the step in pieces, the host between them
    dict(pool_gb="min", ring_slots=8, ring_group=2),
    dict(pool_gb="half", lookahead=False),
    dict(pool_gb="half", host_gb=0.01),  # host tier holds every record: graphs read misses in place
    dict(pool_gb="min", host_gb=0.0003, ring_slots=4, ring_group=1),
    dict(pool_gb=None, decode_mode="handshake"),
    dict(pool_gb=None, decode_mode="eager"),
    dict(pool_gb=None, warm=False),  # the graph captured at the first step instead of at load
    dict(pool_gb=None, max_context=16),  # decode past the reserved context: the caches grow, the graph is recaptured
]


# the prefill ring without its early fetches for the next layer (ring_lookahead, on by default), held to the
# same results
LOOKAHEAD_SETTINGS = [SETTINGS[0], dict(pool_gb="min", ring_slots=8, ring_group=2, ring_lookahead=False),
                      dict(pool_gb="min", host_gb=0.01, ring_lookahead=False)]


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "qwen4_exp_static"])
def test_gpu_same_tokens_and_logits_for_every_setting(tiny, tmp_path, model_type):
    _same_for_every_setting(tiny, tmp_path, model_type, SETTINGS)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gpu_ring_lookahead_keeps_tokens_and_logits(tiny, tmp_path, model_type):
    _same_for_every_setting(tiny, tmp_path, model_type, LOOKAHEAD_SETTINGS)


def test_gpu_requests_in_a_row_replay_the_graph_captured_at_load(tiny):
    """The decode graph is captured at load over the decoder's own state, which every new sequence reuses: the
    second request replays it without capturing again, and gets the first one's tokens."""
    llm = LLM(tiny.store("qwen3_moe"), device="cuda", dtype="bfloat16")
    try:
        graph = llm.decoder.graph
        assert graph is not None
        outs = [llm.generate([prompt_of(llm, PROMPT)], SamplingParams(max_tokens=STEPS)) for _ in range(2)]
        assert llm.decoder.graph is graph and llm.decoder.graph_replays >= 2 * (STEPS - 1)
        assert outs[0][0].token_ids == outs[1][0].token_ids
    finally:
        llm.close()


def test_gpu_a_step_with_records_on_disk_is_captured_in_pieces(tiny):
    """Half the records in the pool, the rest on disk: each decode step replays the pieces captured at its first
    step (one graph from each MoE layer's experts to the next one's routing), the host's turn between them."""
    llm = LLM(tiny.store("qwen3_moe"), device="cuda", dtype="bfloat16", pool_gb=16 * _record_gb(1) * 1.0001)
    try:
        greedy_trace(llm, prompt_of(llm, PROMPT), STEPS)
        pieces = llm.decoder.pieces[1, False][0]
        assert llm.decoder.graph is None and len(pieces) == len(llm.provider.stats.layers) + 1
        assert llm.decoder.graph_replays >= STEPS - 2
    finally:
        llm.close()


def _same_for_every_setting(tiny, tmp_path, model_type, settings):
    # qwen4_exp's tiny model has PLE and indexed attention (eager decode); "qwen4_exp_static" has neither
    store = static_hyper_store(str(tmp_path / "s")) if model_type == "qwen4_exp_static" else tiny.store(model_type)
    reference, lines = None, []
    for setting in settings:
        s = dict(setting)
        if s["pool_gb"] == "min":
            s["pool_gb"] = 2 * _record_gb(1) * 1.0001
        elif s["pool_gb"] == "half":
            s["pool_gb"] = 16 * _record_gb(1) * 1.0001
        llm = LLM(store, device="cuda", dtype="bfloat16", **s)
        try:
            tokens, logits = greedy_trace(llm, prompt_of(llm, PROMPT), STEPS)
            replays = llm.decoder.graph_replays
            totals, layers = llm.stats()["totals"]["q4"], len(llm.provider.stats.layers)
        finally:
            llm.close()
        lines.append(f"{model_type} {setting}: graph replays {replays}, misses {totals['misses']}, "
                     f"tokens {tokens[:8]}")
        # graph replays are counted too: every decode step looked up each MoE layer's experts
        assert totals["hits"] + totals["misses"] == totals["lookups"]
        assert totals["decode_steps"] >= STEPS * layers, setting
        if reference is None:
            reference = (tokens, logits)
            continue
        diff = (logits.float() - reference[1].float()).abs().amax(-1)
        bad = (diff > 0).nonzero().flatten().tolist()
        assert not bad, (f"{setting}: logits differ from row {bad[0]} of {len(diff)} (prompt is {PROMPT} rows), "
                         f"max {diff.max().item():.3g}; tokens equal: {tokens == reference[0]}")
        assert tokens == reference[0], setting
    print("\n".join(lines))
