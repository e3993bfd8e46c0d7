"""Errors the user can cause end in one clear line and a non-zero exit, never a traceback."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from moestream.errors import StoreError
from moestream.experts.format import PROGRESS_FILE
from moestream.experts.store import open_store
from moestream.tiny import make_tiny_checkpoint
from tests.cli.inprocess import run_cli


def moestream(*args):
    return run_cli(*args)


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_no_such_folder(tmp_path):
    assert "no such checkpoint folder" in one_line_error(moestream("pack", str(tmp_path / "nope")))


def test_a_store_is_not_packed_again(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert "is a moestream store, packed already" in one_line_error(moestream("pack", str(tmp_path)))


def test_no_config(tmp_path):
    assert "no config.json" in one_line_error(moestream("pack", str(tmp_path)))


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    msg = one_line_error(moestream("pack", str(tmp_path)))
    assert "'llama'" in msg and "qwen3_moe" in msg and "qwen4_exp" in msg


def test_bad_experts_option(tiny, tmp_path):
    msg = one_line_error(moestream("pack", tiny.checkpoint("qwen3_moe"), "-o", str(tmp_path / "o"), "--experts", "5"))
    assert "--experts" in msg


def test_missing_tensor(tiny, tmp_path):
    from safetensors.torch import save_file

    from tests.packer.helpers import source_tensors

    src = tiny.checkpoint("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = source_tensors(src)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    msg = one_line_error(moestream("pack", str(dst), "-o", str(tmp_path / "out")))
    assert "missing tensor model.layers.2.mlp.experts.5.up_proj.weight" in msg


def test_output_holds_another_store(tiny):
    msg = one_line_error(moestream("pack", tiny.checkpoint("qwen3_moe"), "-o", tiny.store("qwen2_moe")))
    assert "already holds a different store" in msg


def test_output_not_empty(tiny, tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    msg = one_line_error(moestream("pack", tiny.checkpoint("qwen3_moe"), "-o", str(tmp_path)))
    assert "not empty" in msg and (tmp_path / "mine.txt").read_text() == "precious"


def test_killed_pack_is_completed_on_rerun(tmp_path):
    src = make_tiny_checkpoint(str(tmp_path / "ckpt"), "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                               num_experts=64, num_hidden_layers=8)
    out = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "pack", src, "-o", str(out), "--no-progress"],
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / PROGRESS_FILE).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / PROGRESS_FILE).exists() and not (out / "manifest.json").exists()
    with pytest.raises(StoreError, match="unfinished pack"):
        open_store(str(out))
    done = moestream("pack", src, "-o", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert open_store(str(out), verify=True).model.num_hidden_layers == 8


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_damaged_store_is_refused(tiny, tmp_path, damage):
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    path = store / "experts.q4.bin"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 4096]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="experts.q4.bin"):
        open_store(str(store))
