"""The invariance of test_invariance.py on CUDA (bf16): Triton kernels, the ring, graphs and zero-copy."""

import pytest

from moestream.engine.llm import LLM
from tests.engine.runs import greedy_trace, prompt_of, static_hyper_store
from tests.engine.test_invariance import MODEL_TYPES, PROMPT, STEPS, _record_gb

pytestmark = pytest.mark.gpu

SETTINGS = [
    dict(pool_gb=None),  # whole model resident: decode is one CUDA graph
    dict(pool_gb="min"),  # handshake per layer
    dict(pool_gb="min", ring_slots=8, ring_group=2),
    dict(pool_gb="half", lookahead=False),
    dict(pool_gb="half", host_gb=0.01),  # host tier holds every record: graphs read misses in place
    dict(pool_gb="min", host_gb=0.0003, ring_slots=4, ring_group=1),
    dict(pool_gb=None, decode_mode="handshake"),
    dict(pool_gb=None, decode_mode="addressed"),
]


# the prefill ring without its early fetches for the next layer (ring_lookahead, on by default), held to the
# same results
LOOKAHEAD_SETTINGS = [SETTINGS[0], dict(pool_gb="min", ring_slots=8, ring_group=2, ring_lookahead=False),
                      dict(pool_gb="min", host_gb=0.01, ring_lookahead=False)]


# opt-in launches: every decode-path kernel as a dependent of the one before (the same arithmetic: identical
# results); and cuBLAS for a token's dense projections instead of the Triton GEMV (its own arithmetic, so those
# settings are held to each other)
PDL_ALL, CUBLAS = {"MOESTREAM_PDL": "all"}, {"MOESTREAM_DENSE": "cublas"}
ENV = (*PDL_ALL, *CUBLAS)
OPT_IN_SETTINGS = [SETTINGS[0], dict(SETTINGS[0], env=PDL_ALL), dict(pool_gb="min", env=PDL_ALL),
                   dict(pool_gb="half", host_gb=0.01, env=PDL_ALL)]
CUBLAS_SETTINGS = [dict(SETTINGS[0], env=CUBLAS), dict(pool_gb="min", env=CUBLAS),
                   dict(pool_gb="half", host_gb=0.01, env=CUBLAS)]


# prefill with the whole model in the pool, its grouping and tiles built on the GPU (prefill_in_place)
IN_PLACE_SETTINGS = [SETTINGS[0], dict(pool_gb=None, prefill_in_place=True), dict(pool_gb="min")]


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "qwen4_exp_static"])
def test_gpu_same_tokens_and_logits_for_every_setting(tiny, tmp_path, model_type, monkeypatch):
    _same_for_every_setting(tiny, tmp_path, model_type, SETTINGS, monkeypatch)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gpu_ring_lookahead_keeps_tokens_and_logits(tiny, tmp_path, model_type, monkeypatch):
    _same_for_every_setting(tiny, tmp_path, model_type, LOOKAHEAD_SETTINGS, monkeypatch)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gpu_opt_in_kernels_keep_tokens_and_logits(tiny, tmp_path, model_type, monkeypatch):
    _same_for_every_setting(tiny, tmp_path, model_type, OPT_IN_SETTINGS, monkeypatch)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gpu_cublas_projections_keep_tokens_and_logits(tiny, tmp_path, model_type, monkeypatch):
    _same_for_every_setting(tiny, tmp_path, model_type, CUBLAS_SETTINGS, monkeypatch)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gpu_prefill_in_place_keeps_tokens_and_logits(tiny, tmp_path, model_type, monkeypatch):
    from moestream.kernels import ops

    calls = []
    in_place = ops.expert_group_in_place
    monkeypatch.setattr(ops, "expert_group_in_place", lambda *a: calls.append(1) or in_place(*a))
    _same_for_every_setting(tiny, tmp_path, model_type, IN_PLACE_SETTINGS, monkeypatch)
    assert calls  # the in-place setting's prefill took the path


def _same_for_every_setting(tiny, tmp_path, model_type, settings, monkeypatch):
    # qwen4_exp's tiny model has PLE and indexed attention (eager decode); "qwen4_exp_static" has neither
    store = static_hyper_store(str(tmp_path / "s")) if model_type == "qwen4_exp_static" else tiny.store(model_type)
    reference, lines = None, []
    for setting in settings:
        s = dict(setting)
        for name in ENV:  # the defaults unless a setting asks otherwise, whatever the caller's environment
            monkeypatch.delenv(name, raising=False)
        for name, value in s.pop("env", {}).items():
            monkeypatch.setenv(name, value)
        if s["pool_gb"] == "min":
            s["pool_gb"] = 2 * _record_gb(1) * 1.0001
        elif s["pool_gb"] == "half":
            s["pool_gb"] = 16 * _record_gb(1) * 1.0001
        llm = LLM(store, device="cuda", dtype="bfloat16", **s)
        try:
            tokens, logits = greedy_trace(llm, prompt_of(llm, PROMPT), STEPS)
            replays = llm.decoder.graph_replays if llm.decoder else 0
            totals = llm.stats()["totals"]["q4"]
        finally:
            llm.close()
        lines.append(f"{model_type} {setting}: graph replays {replays}, misses {totals['misses']}, "
                     f"tokens {tokens[:8]}")
        # graph replays are counted too: every decode step looked up each MoE layer's experts
        assert totals["hits"] + totals["misses"] == totals["lookups"]
        assert totals["decode_steps"] >= STEPS * len(llm.provider.stats.layers), setting
        if reference is None:
            reference = (tokens, logits)
            continue
        diff = (logits.float() - reference[1].float()).abs().amax(-1)
        bad = (diff > 0).nonzero().flatten().tolist()
        assert not bad, (f"{setting}: logits differ from row {bad[0]} of {len(diff)} (prompt is {PROMPT} rows), "
                         f"max {diff.max().item():.3g}; tokens equal: {tokens == reference[0]}")
        assert tokens == reference[0], setting
    print("\n".join(lines))
