"""A .safetensors file whose header does not fit it is refused in one line naming the file, never trusted
(trusting its lengths meant allocating whatever they claimed)."""

import json
import random
import shutil
import struct
import subprocess
import sys

import pytest

from moestream.errors import SourceError
from moestream.packer.safetensors_io import read_header


def with_header(header: dict | list, data: bytes = b"") -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


GARBAGE = {
    "random bytes": lambda: random.Random(0).randbytes(4 << 20),
    "a header claiming 2**62 bytes": lambda: struct.pack("<Q", 2**62) + b"{}",
    "offsets past the end": lambda: with_header(
        {"w": {"dtype": "BF16", "shape": [2**39], "data_offsets": [0, 2**40]}}, b"\0" * 64),
    "offsets past the end, shape to match": lambda: with_header(
        {"w": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]}}, b"\0" * 64),
    "offsets that disagree with the shape": lambda: with_header(
        {"w": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 64]}}, b"\0" * 64),
    "a header that is not an object": lambda: with_header([1, 2]),
    "a malformed entry": lambda: with_header({"w": {"dtype": "BF16", "shape": "big", "data_offsets": [0, 2]}}),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_garbage_header_is_refused(tmp_path, case):
    path = tmp_path / "model.safetensors"
    path.write_bytes(GARBAGE[case]())
    with pytest.raises(SourceError) as e:
        read_header(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_sound_header_still_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(with_header({"__metadata__": {"format": "pt"},
                                  "w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}, b"\0" * 64))
    info = read_header(str(path))["w"]
    assert (info.shape, info.nbytes, info.start) == ((4, 8), 64, path.stat().st_size - 64)


def test_pack_of_a_garbage_checkpoint_ends_in_one_line(tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), ckpt)
    (ckpt / "model.safetensors").write_bytes(GARBAGE["a header claiming 2**62 bytes"]())
    proc = subprocess.run([sys.executable, "-m", "moestream", "pack", str(ckpt), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "model.safetensors" in lines[0] and "header" in lines[0]
