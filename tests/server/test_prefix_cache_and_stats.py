"""Prefix cache through the server (same output, prefill tokens skipped), /v1/stats and /metrics."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moestream.sampling import SamplingParams
from tests.server.conftest import CHUNK, MODEL

SYSTEM = "You answer questions about mixture-of-experts inference engines, briefly and exactly. " * 2


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def expected_cached(previous: list[int], ids: list[int]) -> int:
    """The deepest chunk boundary inside the common prefix, leaving one prompt token to compute."""
    common = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
    return min(common, len(ids) - 1) // CHUNK * CHUNK


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])  # qwen3_next: DeltaNet state restored too
def test_repeated_prefix_is_served_from_the_cache(serve, reference, tiny, model_type):
    store = tiny.store(model_type)
    server, ref = serve(store, prefix_cache_mb=50), reference(store)
    client = server.client()
    seen, skipped = [], 0
    for question, stream in [("What is a pool?", False), ("What is a ring?", False), ("What is a ring?", True)]:
        ids = ref.tokenizer.chat(chat(question))
        want = ref.chat(chat(question), SamplingParams(max_tokens=8))
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=8,
                                                         stream=True, stream_options={"include_usage": True}))
            text, use = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            r = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=8)
            text, use = r.choices[0].message.content, r.usage
        assert text == want.text
        cached = max((expected_cached(p, ids) for p in seen), default=0)
        assert use.prompt_tokens_details.cached_tokens == cached
        seen.append(ids)
        skipped += cached
    assert skipped > len(SYSTEM)  # most of the system prompt, twice
    cache = server.stats()["server"]["prefix_cache"]
    assert (cache["hits"], cache["misses"], cache["cached_tokens"]) == (2, 1, skipped)
    with server.http() as http:
        families = text_string_to_metric_families(http.get("/metrics").text)
        samples = {s.name: s.value for f in families for s in f.samples}
    assert samples["moestream_prefix_cache_skipped_prefill_tokens_total"] == skipped
    assert samples["moestream_prefix_cache_hits_total"] == 2


def test_metrics_parse_and_carry_expert_counters(serve, tiny):
    server = serve(tiny.store("qwen3_moe"))
    client = server.client()
    client.completions.create(model=MODEL, prompt="count the experts", max_tokens=4)
    client.chat.completions.create(model=MODEL, messages=chat("and now?"), max_tokens=4)
    with server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]

    def value(name: str, **labels) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    totals = server.llm.stats()["totals"]["q4"]
    for counter in ("lookups", "hits", "misses"):
        assert value(f"moestream_expert_{counter}_total", precision="q4") == totals[counter]
    for tier in ("gpu", "host", "disk"):
        assert value("moestream_expert_read_bytes_total", precision="q4", tier=tier) == totals["reads"][tier]["bytes"]
    assert value("moestream_expert_lookups_total") > 0
    assert value("moestream_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value("moestream_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value("moestream_generation_tokens_total") >= 2 and value("moestream_prompt_tokens_total") > 0
    assert value("moestream_request_latency_seconds_count", endpoint="/v1/completions") == 1
    assert value("moestream_speculation_steps_total") == 0  # speculation is off by default
    assert value("moestream_queue_depth") == 0


def test_stats_json_has_the_engine_snapshot_per_layer(serve, tiny):
    server = serve(tiny.store("qwen3_moe"))
    server.client().completions.create(model=MODEL, prompt="layers, please", max_tokens=4)
    stats = server.stats()
    assert set(stats) == {"engine", "server", "model"}
    assert stats["engine"] == server.llm.stats()  # idle: exactly the engine's snapshot
    layers = stats["engine"]["layers"]
    assert len(layers) == stats["model"]["record_layers"] == server.llm.config.num_record_layers
    assert all(layer["q4"]["lookups"] > 0 for layer in layers)
    assert {"direct_io", "totals", "prefill_timings"} <= set(stats["engine"])
    s = stats["server"]
    assert s["requests"]["completed"] == 1 and s["tokens"]["generated"] >= 1 and s["uptime_seconds"] > 0
    assert s["queue"] == {"waiting": 0, "max_waiting": 64, "running": 0}
    assert s["prefix_cache"] is None  # off unless asked for
    assert stats["model"]["id"] == MODEL and stats["model"]["model_type"] == "qwen3_moe"
