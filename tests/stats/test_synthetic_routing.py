"""Synthetic stores whose routers follow a recorded trace's expert popularity (benchmarks/synthetic.py)."""

import random

import torch

from benchmarks.synthetic import build, popularity, resample
from moestream.engine.llm import LLM
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams
from moestream.stats.trace import RoutingTrace, load

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64,
             intermediate_size=256, num_experts=32, num_experts_per_tok=4, vocab_size=512)


def skewed_trace(path: str, layers: int = 2, experts: int = 32, tokens: int = 400) -> None:
    """A trace whose layers pick experts with Zipf-like popularity."""
    rng = random.Random(0)
    weights = [1 / (r + 1) ** 1.2 for r in range(experts)]
    with open(path, "w") as f:
        trace = RoutingTrace(f, layers, experts, 4, 64)
        for _ in range(tokens):
            for layer in range(layers):
                picks = set()
                while len(picks) < 4:
                    picks.add(rng.choices(range(experts), weights)[0])
                trace.step(layer, [sorted(picks)])


def top_quarter(path: str, prompt: list[int]) -> list[float]:
    llm = LLM(path, device="cpu")
    with open(path + ".trace", "w") as f:
        llm.provider.trace(f)
        llm.generate([prompt], SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0, seed=1))
        llm.provider.trace(None)
    llm.close()
    return [float(c[:8].sum()) for c in popularity(load(path + ".trace"))]


def test_routers_follow_a_traces_popularity_on_held_out_decode(tmp_path):
    skewed_trace(str(tmp_path / "trace.jsonl"))
    target = [float(resample(c, 32)[:8].sum()) for c in popularity(load(str(tmp_path / "trace.jsonl")))]
    build(str(tmp_path / "uniform"), "qwen3-30b", layers=2, **SMALL)
    build(str(tmp_path / "skewed"), "qwen3-30b", layers=2, routing=str(tmp_path / "trace.jsonl"), **SMALL)
    assert open_store(str(tmp_path / "skewed")).manifest.source["routing"] == "trace.jsonl"  # checksums still hold
    prompt = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(5)).tolist()  # not the build's
    uniform, skewed = top_quarter(str(tmp_path / "uniform"), prompt), top_quarter(str(tmp_path / "skewed"), prompt)
    for u, s, t in zip(uniform, skewed, target):
        assert abs(s - t) < 0.1 and s > u + 0.1, (uniform, skewed, target)
