"""`moestream perplexity` on CPU: equal to transformers' over the same windows, every precision, one-line errors."""

import json
import math
import subprocess

import pytest
import torch

from tests.cli.inprocess import run_cli
from tests.models.oracle import hf_logits

TEXT = "the expert pool holds the most used experts of each layer, and the ring streams the rest from disk.\n"
CTX, STRIDE = "32", "12"  # about 100 tokens: 8 windows, the last one short


def perplexity(store: str, file: str, *args: str) -> subprocess.CompletedProcess:
    return run_cli("perplexity", store, str(file), "--device", "cpu", "--ctx", CTX, "--stride", STRIDE, *args)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return path


def reference(checkpoint: str, store: str, ctx: int, stride: int) -> tuple[float, int, int]:
    """(perplexity, tokens scored, windows) from transformers, with the standard strided windows written out here."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(store).encode(TEXT, add_special_tokens=False)
    nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        window = torch.tensor(ids[begin:end])
        logp = hf_logits(checkpoint, window).double().log_softmax(-1)  # [T, vocab]
        first = max(prev_end - begin, 1)  # the first window scores all but its first token
        nll -= logp[first - 1:-1].gather(1, window[first:, None]).sum().item()
        scored, windows, prev_end = scored + len(window) - first, windows + 1, end
        if end == len(ids):
            break
    return math.exp(nll / scored), scored, windows


@pytest.mark.parametrize("experts", ["4", "16"])
def test_equals_transformers_over_the_same_windows(tiny, text_file, experts):
    store = tiny.store("qwen3_moe")
    oracle = tiny.dequantized("qwen3_moe") if experts == "4" else tiny.checkpoint("qwen3_moe")
    proc = perplexity(store, text_file, "--experts", experts, "--json", "--pool-gb", "0.0001")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ppl, scored, windows = reference(oracle, store, int(CTX), int(STRIDE))
    assert (out["tokens_scored"], out["windows"]) == (scored, windows)
    assert out["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert out["precision"] == ("q4" if experts == "4" else "bf16")


def test_json_summary_keys(tiny, text_file):
    proc = perplexity(tiny.store("qwen3_moe"), text_file, "--json", "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"perplexity", "nll_per_token", "tokens_scored", "windows", "ctx", "stride", "precision",
                        "miss_precision", "seconds", "tok_s", "experts"}
    assert out["tokens_scored"] == 39 and out["windows"] == 2  # --max-tokens 40: windows [0, 32) and [12, 40)
    assert out["perplexity"] == pytest.approx(math.exp(out["nll_per_token"]))
    assert out["experts"]["q4"]["lookups"] > 0 and out["tok_s"] > 0
    assert "perplexity" in proc.stderr and "tok/s" in proc.stderr


def test_low_bits_give_a_finite_and_different_perplexity(tiny, text_file):
    store = tiny.store("qwen3_moe")
    runs = {}
    for args in (["--experts", "4"], ["--experts", "2"], ["--experts", "4", "--miss-experts", "2"]):
        proc = perplexity(store, text_file, "--json", "--pool-gb", "0.0001", *args)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        runs[" ".join(args)] = out["perplexity"]
        assert math.isfinite(out["perplexity"])
    assert runs["--experts 2"] != runs["--experts 4"] != runs["--experts 4 --miss-experts 2"]


@pytest.mark.parametrize("case, message", [
    ("missing", "cannot read"), ("empty", "is empty"), ("short", "too short"), ("binary", "not UTF-8"),
    ("ctx", "above this model's context"), ("stride", "--stride"),
])
def test_bad_input_ends_in_one_line(tiny, tmp_path, case, message):
    file, args = tmp_path / "text.txt", []
    file.write_bytes({"empty": b"", "short": b"a", "binary": b"\xff\xfe text"}.get(case, TEXT.encode()))
    if case == "missing":
        file = tmp_path / "absent.txt"
    args = {"ctx": ["--ctx", "100000"], "stride": ["--stride", "600"]}.get(case, [])
    proc = run_cli("perplexity", tiny.store("qwen3_moe"), str(file), "--device", "cpu", *args)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
