"""`generate --trace-routing` on CPU: one line per (token processed, MoE layer); `moestream simulate` on the trace;
and the engine's measured hit rate equal to the simulator's `engine` row at the same pool size."""

import json
import subprocess

import pytest

from moestream.experts.store import open_store
from tests.cli.inprocess import run_cli

PROMPT = "The expert pool holds the records a step needs; the ring streams the rest. " * 3
TOKENS = 10


def moestream(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args)


def generate(store: str, path, *args: str) -> dict:
    proc = moestream("generate", store, PROMPT, "--device", "cpu", "--raw", "--json", "--max-tokens", str(TOKENS),
                     "--trace-routing", str(path), *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def simulate(path, *args: str) -> dict:
    proc = moestream("simulate", str(path), "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_trace_has_every_token_of_every_moe_layer(tiny, tmp_path):
    store = tiny.store("qwen3_moe")
    out = generate(store, tmp_path / "t.jsonl", "--pool-gb", "0.0001")
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    head, records = lines[0], lines[1:]
    model = open_store(store).model
    layers, top_k = len(model.moe_layer_ids), model.num_experts_per_tok
    prompt = out["stats"]["timings"]["prompt_tokens"]
    processed = prompt + len(out["token_ids"]) - 1  # the last token sampled is never fed back
    assert head["trace"] == "routing" and head["top_k"] == top_k
    assert len(records) == processed * layers
    assert all(len(r["experts"]) == top_k and 0 <= min(r["experts"]) for r in records)
    for layer in range(layers):
        mine = [r for r in records if r["layer"] == layer]
        assert [r["position"] for r in mine] == list(range(processed))
        assert [r["phase"] for r in mine] == ["prefill"] * prompt + ["decode"] * (processed - prompt)
    proc = moestream("simulate", str(tmp_path / "t.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert all(name in proc.stdout for name in ("lru", "lfu", "engine", "min", "reuse", "layer"))


@pytest.mark.parametrize("pool_gb", ["0.0001", "0.0002"])  # 12 and 24 of 32 records
def test_the_engine_row_is_the_measured_hit_rate(tiny, tmp_path, pool_gb):
    store = tiny.store("qwen3_moe")
    s = open_store(store)
    slots = min(int(float(pool_gb) * 1e9 // s.manifest.layouts["q4"].stride), s.manifest.geometry.num_records)
    out = generate(store, tmp_path / "t.jsonl", "--pool-gb", pool_gb, "--no-lookahead")
    q4 = out["stats"]["experts"]["q4"]
    assert out["stats"]["timings"]["prompt_tokens"] >= 32  # the prompt goes through the prefill ring
    sim = simulate(tmp_path / "t.jsonl", "--slots", str(slots))
    assert sim["lookups"] == q4["lookups"]
    assert sim["hits"]["engine"] == [q4["hits"]]
    assert sim["hits"]["min"][0] >= q4["hits"]


def test_a_file_that_is_not_a_trace_is_one_line(tmp_path):
    (tmp_path / "x").write_text("hello\n")
    proc = moestream("simulate", str(tmp_path / "x"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    proc = moestream("simulate", str(tmp_path / "missing"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr


def test_steps_read_by_address_are_traced_in_step_order(tiny):
    """A graph replay's routing is written when it is counted: before the next host step's, never after."""
    import torch

    from moestream.engine.llm import LLM
    from moestream.sampling import SamplingParams
    from moestream.stats.trace import parse

    llm = LLM(tiny.store("qwen3_moe"), device="cpu", pool_gb=0.0001)
    try:
        g, top_k, lines = llm.provider.geometry, llm.config.num_experts_per_tok, []
        llm.provider.trace(lines)
        routed = torch.arange(g.num_layers * top_k).view(g.num_layers, top_k) % g.num_experts
        llm.provider.note_addressed(routed)  # two steps read by address, not counted yet
        llm.provider.note_addressed(routed.flip(0))
        llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
        llm.provider.trace(None)
        llm.provider.note_addressed(routed)  # not traced
        llm.provider.totals()
    finally:
        llm.close()
    t = parse(lines)
    assert [(s.layer, s.phase, len(s.rows)) for s in t.steps[: 2 * g.num_layers + 1]] == \
        [(layer, "decode", 1) for layer in range(g.num_layers)] * 2 + [(0, "prefill", 6)]
    assert t.steps[0].rows == [routed[0].tolist()] and t.steps[g.num_layers].rows == [routed[-1].tolist()]
    assert len(lines) == 1 + g.num_layers * (2 + 6 + 2)
