"""Experts spread over ranks (`gpus=N`; here CPU processes on gloo): the same greedy tokens and bit-identical
logits on 1, 2 and 4 ranks, with the whole model in each rank's pool and with small pools streaming from a host
tier; batched generation; stats per rank; the option's refusals."""

import json

import pytest
import torch

from moestream.cli.demo import DEMO_STORE
from moestream.config import EngineConfig
from moestream.engine.llm import LLM
from moestream.errors import ConfigError
from moestream.sampling import SamplingParams
from moestream.stats.render import summary_table
from tests.cli.inprocess import run_cli
from tests.engine.runs import greedy_trace, prompt_of
from tests.engine.test_invariance import PROMPT, _resolve

STEPS = 12
SMALL = dict(pool_gb="min", host_gb=0.01, ring_slots=8, ring_group=2)  # each rank streams its misses


def _trace(store: str, **options) -> tuple[list[int], torch.Tensor, dict]:
    llm = LLM(store, device="cpu", dtype="float32", **options)
    try:
        tokens, logits = greedy_trace(llm, prompt_of(llm, PROMPT), STEPS)
        return tokens, logits, llm.stats()
    finally:
        llm.close()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "qwen3_next"])
def test_greedy_tokens_and_logits_are_the_same_on_one_two_and_four_ranks(tiny, model_type):
    store = tiny.store(model_type)
    tokens, logits, stats = _trace(store)
    for gpus, setting in [(2, {}), (4, {}), (2, SMALL)]:
        got, got_logits, got_stats = _trace(store, gpus=gpus, **_resolve(SMALL, 2, 32) if setting else {})
        assert got == tokens, (gpus, setting)
        assert torch.equal(got_logits, logits), (gpus, setting)
        ranks = got_stats["ranks"]
        assert [r["rank"] for r in ranks] == list(range(gpus))
        assert got_stats["totals"]["q4"]["lookups"] == sum(r["totals"]["q4"]["lookups"] for r in ranks)
        assert all(r["totals"]["q4"]["lookups"] > 0 for r in ranks)  # every rank computed its share
        if setting:
            assert got_stats["totals"]["q4"]["misses"] > 0
        else:  # a step's lookups are the same however they are spread
            assert got_stats["totals"]["q4"]["lookups"] == stats["totals"]["q4"]["lookups"]


def test_each_rank_keeps_only_its_own_experts(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", gpus=2, **_resolve(dict(pool_gb="half"), 2, 32))
    try:
        llm.generate([prompt_of(llm, PROMPT)], SamplingParams(max_tokens=4))
        resident = llm.provider.call("snapshot")[0]["experts"]
    finally:
        llm.close()
    held = [e for layer in resident for e in layer["resident"]]
    assert held and all(e % 2 == 1 for e in held)


def test_mtp_drafts_on_two_ranks_keep_the_tokens():
    """The MTP head's experts (one more record layer) are spread too."""
    params, outs = SamplingParams(max_tokens=16), []
    for gpus in (1, 2):
        llm = LLM(DEMO_STORE, device="cpu", gpus=gpus, speculation="mtp")
        try:
            outs.append(llm.generate(["def fibonacci(n):\n    "], params)[0].token_ids)
            assert llm.stats()["speculation"]["steps"] > 0
        finally:
            llm.close()
    assert outs[0] == outs[1]


def test_uncounted_steps_leave_every_ranks_counters(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", gpus=2)
    try:
        with llm.provider.uncounted():  # the warm-up's way
            llm.generate([prompt_of(llm, PROMPT)], SamplingParams(max_tokens=2))
        assert [r["totals"].get("q4", {}).get("lookups", 0) for r in llm.stats()["ranks"]] == [0, 0]
    finally:
        llm.close()


def test_batched_prompts_on_two_ranks_get_what_each_gets_alone(tiny):
    store = tiny.store("qwen3_moe")
    params = SamplingParams(max_tokens=8)
    alone = LLM(store, device="cpu")
    prompts = [prompt_of(alone, n, seed) for seed, n in enumerate((5, 40, 12))]
    want = [alone.generate([p], params)[0].token_ids for p in prompts]
    alone.close()
    llm = LLM(store, device="cpu", gpus=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.close()


def test_the_command_line_takes_gpus(tiny):
    runs = [run_cli("generate", tiny.store("qwen3_moe"), "The pool", "--device", "cpu", "--max-tokens", "4", "--json",
                    *gpus) for gpus in ([], ["--gpus", "2"])]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert json.loads(runs[0].stdout)["token_ids"] == json.loads(runs[1].stdout)["token_ids"]


def test_the_stats_table_shows_each_ranks_share():
    rank = {"pool": {"resident": 3, "slots": 8, "host_slots": 0}, "totals": {"q4": {"hits": 3, "lookups": 4}}}
    stats = {"totals": {}, "pool": {"resident": 3, "slots": 8, "precision": "q4", "stride": 4096, "ring_slots": 4,
                                    "host_slots": 0}, "ranks": [rank | {"rank": 0}, rank | {"rank": 1}]}
    caption = summary_table(stats).caption
    assert "GPU 0: pool 3/8, 75% hits (3/4)" in caption and "GPU 1:" in caption


@pytest.mark.parametrize("options,message", [(dict(gpus=0), "--gpus 0"), (dict(gpus=2, gpu_gb=8.0), "--gpu-gb")])
def test_bad_gpu_counts_are_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)
