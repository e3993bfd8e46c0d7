"""The training script on CPU: it learns, a stopped-and-resumed run equals an uninterrupted one, and its export
loads in transformers and packs with moestream."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from moestream.packer.pack import PackOptions, pack
from moestream.tiny import make_tiny_tokenizer
from training.train import TrainArgs, parse_args, train

STEPS = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """Random phrases from a small set, repeated: a stream a tiny model learns within a few dozen steps."""
    path = str(tmp_path_factory.mktemp("data"))
    rng = np.random.default_rng(0)
    phrases = [rng.integers(3, 320, size=rng.integers(4, 12)) for _ in range(40)]
    stream = np.concatenate([phrases[i] for i in rng.integers(0, 40, size=3000)]).astype(np.uint16)
    cut = len(stream) * 9 // 10
    stream[:cut].tofile(os.path.join(path, "train.bin"))
    stream[cut:].tofile(os.path.join(path, "valid.bin"))
    make_tiny_tokenizer(path)
    return path


def args(data: str, out: str, **kw) -> TrainArgs:
    base = dict(size="tiny", vocab=320, steps=STEPS, batch=8, seq=32, warmup=5, log_every=5, eval_every=10,
                eval_batches=2, ckpt_every=10, seed=3)
    return TrainArgs(data=data, out=out, **{**base, **kw})


@pytest.fixture(scope="module")
def full_run(data, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("full"))
    train(args(data, out))
    return out


def log(out: str) -> list[dict]:
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_loss_decreases_and_is_logged(full_run):
    records = [r for r in log(full_run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(5, STEPS + 1, 5))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"] - 0.3
    assert records[-1]["valid_loss"] < 5.5 and records[-1]["tokens_per_s"] > 0


def test_stop_and_resume_equals_an_uninterrupted_run(data, full_run, tmp_path):
    out = str(tmp_path / "resumed")
    train(args(data, out, stop_at=STEPS // 2 + 3))  # stops between checkpoints: the checkpoint is written anyway
    assert [r.get("event") for r in log(out)][-1] == "stopped"
    train(args(data, out, resume=True))
    a = torch.load(os.path.join(full_run, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert a["step"] == b["step"] == STEPS
    for part in ("trunk", "mtp"):
        assert a[part].keys() == b[part].keys()
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert [r["loss"] for r in log(full_run) if "loss" in r][-1] == [r["loss"] for r in log(out) if "loss" in r][-1]


def test_resume_refuses_other_run_arguments(data, full_run):
    with pytest.raises(SystemExit, match="--lr"):
        train(args(data, full_run, resume=True, lr=1e-3))
    with pytest.raises(SystemExit, match="exists"):
        train(args(data, full_run))


def test_export_loads_in_transformers_and_packs(full_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = os.path.join(full_run, "model")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(os.listdir(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = torch.load(os.path.join(full_run, "ckpt.pt"), weights_only=True)["trunk"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, state[name].to(torch.bfloat16)), name
    assert AutoTokenizer.from_pretrained(model_dir).eos_token_id == 1  # <|im_end|>; documents end with <|endoftext|>
    assert model.config.eos_token_id == [1, 0]
    manifest = pack(model_dir, str(tmp_path / "store"), PackOptions(precisions=("q4",), show_progress=False))
    assert manifest.geometry.layer_ids == (0, 1, -1)


def test_cli_parses_into_frozen_args():
    a = parse_args(["--data", "d", "--out", "o", "--steps", "7", "--mtp-weight", "0.5", "--resume"])
    assert (a.steps, a.mtp_weight, a.resume, a.size) == (7, 0.5, True, "demo")
