"""A pack killed at any point and run again ends byte for byte like an uninterrupted pack, manifest included.

The kills are deterministic: a helper process imports the packer once and forks one child per kill point
(before any torch work, so each child starts clean); the child wraps one step of the pack so that it
SIGKILLs itself at that step's Nth call, before or after the step runs."""

import json
import os
import signal
import subprocess
import sys

from moestream.cli import main
from tests.packer.helpers import load_manifest

KILLER = r"""
import json, os, signal, sys
import moestream.packer.dense as dense
import moestream.packer.pack as pack_module
from moestream.cli import main
from moestream.packer.safetensors_io import SafetensorsWriter

owners = {"pack": pack_module, "checks": pack_module.checks, "dense": dense, "os": os, "writer": SafetensorsWriter}
src, points, status = sys.argv[1], json.loads(sys.argv[2]), {}
for out, (owner, name, nth, when) in points.items():
    if (pid := os.fork()) == 0:
        real, calls = getattr(owners[owner], name), [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(owners[owner], name, dying)
        os._exit(main(["pack", src, "-o", out, "--experts", "4,16", "--no-progress"]))
    status[out] = os.waitpid(pid, 0)[1]
print(json.dumps(status))
"""


def kill_points(num_layers: int, num_experts: int) -> dict[str, tuple[str, str, int, str]]:
    """Where to die: (owner, step, nth call, before/after). `os.replace` ends every progress, dense and manifest
    write: the first progress record, one per layer, the dense file, its progress record, the manifest."""
    return {
        "output folder made, nothing written": ("pack", "_write_json_atomic", 1, "before"),
        "first progress record written, not renamed": ("os", "replace", 1, "before"),
        "inside the first layer": ("pack", "encode_all", 3, "before"),
        "first layer written, its progress not": ("os", "replace", 2, "before"),
        "between layers": ("pack", "_write_json_atomic", 2, "after"),
        "inside a later layer": ("pack", "encode_all", num_experts + 3, "before"),
        "experts done, dense file not begun": ("pack", "write_dense", 1, "before"),
        "inside the dense file": ("writer", "write", 2, "after"),
        "dense file written, not renamed": ("os", "replace", num_layers + 2, "before"),
        "dense file done, its progress not": ("pack", "write_dense", 1, "after"),
        "inside an n-gram table": ("dense", "_ngram_rows", 1, "after"),
        "copying the tokenizer": ("pack", "_copy_tokenizer", 1, "before"),
        "verifying": ("pack", "verify_samples", 1, "before"),
        "checksums": ("checks", "file_check", 2, "before"),
        "manifest written, not renamed": ("os", "replace", num_layers + 4, "before"),
        "manifest in place, progress file not removed": ("pack", "_write_json_atomic", num_layers + 3, "after"),
    }


def pack_cli(src: str, out: str) -> None:
    assert main(["pack", src, "-o", out, "--experts", "4,16", "--no-progress"]) == 0


def differing_files(out: str, want: str) -> list[str]:
    def read(path):
        with open(path, "rb") as f:
            return f.read()

    names = sorted(set(os.listdir(out)) | set(os.listdir(want)))
    return [n for n in names if not (os.path.isfile(os.path.join(out, n)) and os.path.isfile(os.path.join(want, n))
                                     and read(os.path.join(out, n)) == read(os.path.join(want, n)))]


def test_a_pack_killed_at_any_point_resumes_to_the_same_bytes(tiny, tmp_path):
    src = tiny.checkpoint("qwen4_exp")  # every phase: experts, dense file, n-gram tables, tokenizer
    want = str(tmp_path / "uninterrupted")
    pack_cli(src, want)
    geometry = load_manifest(want).geometry
    points = kill_points(geometry.num_layers, geometry.num_experts)
    outs = {str(tmp_path / f"killed{i}"): point for i, point in enumerate(points.values())}
    proc = subprocess.run([sys.executable, "-c", KILLER, src, json.dumps(outs)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout)
    for label, out in zip(points, outs):
        killed = os.WIFSIGNALED(status[out]) and os.WTERMSIG(status[out]) == signal.SIGKILL
        assert killed, f"{label}: the pack was not killed there; {proc.stderr[-2000:]}"
        pack_cli(src, out)
        assert not differing_files(out, want), f"{label}: {differing_files(out, want)} differ"
