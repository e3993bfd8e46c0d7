"""A Q3/Q2 file derived from a finished Q4 store equals the one `pack` writes, a cut-short derivation
resumes from its temporary file instead of starting over, and processes deriving at once take turns."""

import glob
import shutil
import subprocess
import sys
import time

import pytest

from moestream.experts.store import open_store
from moestream.packer import lowbit
from moestream.packer.pack import PackOptions, pack
from moestream.packer.records import derive_record


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("packed") / "store")
    pack(tiny.checkpoint("qwen3_moe"), out, PackOptions(precisions=("q4", "q3"), show_progress=False))
    return out


def q4_only(tiny, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny.store("qwen3_moe", experts=("q4",)), store)
    return store


def test_derived_file_equals_the_packed_one(packed, tiny, tmp_path):
    store = q4_only(tiny, tmp_path)
    lowbit.ensure_precision(str(store), "q3", show_progress=False)
    assert (store / "experts.q3.bin").read_bytes() == open(f"{packed}/experts.q3.bin", "rb").read()
    assert "q3" in open_store(str(store), verify=True).manifest.layouts
    assert not glob.glob(str(store / "*.partial"))


def test_cut_short_derivation_resumes(packed, tiny, tmp_path, monkeypatch):
    store = q4_only(tiny, tmp_path)
    want = open(f"{packed}/experts.q3.bin", "rb").read()
    stride = len(want) // open_store(packed).manifest.geometry.num_records
    monkeypatch.setattr(lowbit, "BATCH", 2)
    partial_name = f"experts.q3.bin.{open_store(str(store)).manifest.files['experts.q4.bin'].sha256[:16]}.partial"
    # six records done, then a torn write; the records a resume must redo are poisoned to prove they are redone
    (store / partial_name).write_bytes(want[: 4 * stride] + b"\xff" * (2 * stride + 100))
    derived = []
    monkeypatch.setattr(lowbit, "derive_record", lambda r, *a: derived.append(len(r)) or derive_record(r, *a))
    lowbit.ensure_precision(str(store), "q3", show_progress=False)
    assert (store / "experts.q3.bin").read_bytes() == want
    assert sum(derived) == len(want) // stride - 4
    assert open_store(str(store), verify=True).manifest.layouts["q3"].stride == stride


def test_a_temporary_file_longer_than_the_result_is_cut_back(packed, tiny, tmp_path, monkeypatch):
    store = q4_only(tiny, tmp_path)
    want = open(f"{packed}/experts.q3.bin", "rb").read()
    monkeypatch.setattr(lowbit, "BATCH", 2)
    partial_name = f"experts.q3.bin.{open_store(str(store)).manifest.files['experts.q4.bin'].sha256[:16]}.partial"
    (store / partial_name).write_bytes(want + b"\xff" * (len(want) // 4))
    lowbit.ensure_precision(str(store), "q3", show_progress=False)
    assert (store / "experts.q3.bin").read_bytes() == want


DERIVE_ON_GO = r"""
import os, sys, time
from moestream.packer import lowbit

real = lowbit.derive_record
lowbit.BATCH = 8


def slow(*args):  # long enough for the other process to start while this one derives
    time.sleep(0.1)
    return real(*args)


lowbit.derive_record = slow
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.002)
lowbit.ensure_precision(sys.argv[1], "q2", show_progress=False)
"""


def test_two_processes_deriving_at_once_both_succeed(tiny, tmp_path):
    alone = q4_only(tiny, tmp_path / "alone")
    lowbit.ensure_precision(str(alone), "q2", show_progress=False)
    store, go = q4_only(tiny, tmp_path / "shared"), tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", DERIVE_ON_GO, str(store), str(r), str(go)],
                              stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.time() + 120
    while not all(r.exists() for r in ready) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    for name in ("experts.q2.bin", "manifest.json"):
        assert (store / name).read_bytes() == (alone / name).read_bytes(), name
    assert not glob.glob(str(store / "*.partial"))
