"""`moestream generate` on CPU: text for every model type, --json, and greedy tokens equal to transformers."""

import json
import subprocess
import sys

import pytest
import torch

from tests.cli.inprocess import run_cli
from tests.conftest import MODEL_TYPES
from tests.models.oracle import hf_model

PROMPT = "The expert pool holds"


def generate(store: str, *args: str) -> subprocess.CompletedProcess:
    return run_cli("generate", store, PROMPT, "--device", "cpu", *args)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_json_greedy_equals_transformers(tiny, model_type):
    store = tiny.store(model_type)
    proc = generate(store, "--raw", "--json", "--max-tokens", "12", "--pool-gb", "0.0001")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    assert out["stats"]["experts"]["q4"]["lookups"] > 0
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(store).encode(PROMPT, add_special_tokens=False)
    ref = hf_model(tiny.dequantized(model_type)).generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert out["token_ids"] == ref[0, len(ids):].tolist()


def test_prompt_lookup_keeps_the_tokens_and_reports_its_drafts(tiny):
    store, args = tiny.store("qwen3_next"), ("--raw", "--json", "--max-tokens", "16")
    plain = json.loads(generate(store, *args).stdout)
    proc = generate(store, *args, "--spec", "lookup", "--drafts", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == plain["token_ids"] and out["stats"]["speculation"]["steps"] > 0
    assert plain["stats"]["speculation"]["steps"] == 0


def test_streams_text_and_reports_on_stderr(tiny):  # the real entry point, in a process of its own
    proc = subprocess.run([sys.executable, "-m", "moestream", "generate", tiny.store("qwen3_moe"), PROMPT, "--device",
                           "cpu", "--max-tokens", "8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr and "hits" in proc.stderr


def test_a_ring_of_no_slots_is_refused_in_one_line(tiny):
    proc = generate(tiny.store("qwen3_moe"), "--ring", "0")
    assert proc.returncode == 1 and proc.stderr.strip() == "error: need --ring >= 1 and --group >= 1", proc.stderr


def test_a_bf16_only_store_runs_at_its_own_precision(tiny):
    """A store packed with `--experts 16` alone opens with no --experts: the precision follows the store."""
    store = tiny.store("qwen3_moe", experts=("bf16",))
    proc = generate(store, "--json", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["experts"]["bf16"]["lookups"] > 0
    proc = generate(store, "--experts", "4")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "q4" in proc.stderr, proc.stderr


@pytest.mark.parametrize("option", [["--pool-gb", "nan"], ["--host-gb", "-5"], ["--ring", "0"],
                                    ["--max-context", "0"], ["--prefix-cache-mb", "inf"]])
def test_engine_options_out_of_range_are_one_line(tiny, option):
    proc = generate(tiny.store("qwen3_moe"), *option)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "temperature"), (["--pool-gb", "nan"], "--pool-gb"), (["--host-gb", "-5"], "--host-gb"),
    (["--repetition-penalty", "nan"], "repetition_penalty"), (["--presence-penalty", "nan"], "presence_penalty"),
    (["--gpu-gb", "nan"], "--gpu-gb"), (["--seed", "1e20"], "--seed"),
])
def test_values_out_of_range_end_in_one_line(tiny, args, message):
    proc = generate(tiny.store("qwen3_moe"), "--max-tokens", "2", *args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]
