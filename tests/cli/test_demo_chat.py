"""`moestream demo` and `moestream chat` from a fresh home folder, on CPU."""

import os
import re
import subprocess
import sys

ENGLISH = set("the a an of to and in is are be for that this it with as by on or not from can which if its "
              "function module file value type data used use return set default name new object method "
              "python list see also when all one may has".split())


def test_demo_runs_the_trained_model_from_the_package(tmp_path):
    cmd = [sys.executable, "-m", "moestream", "demo", "--device", "cpu", "--max-tokens", "32"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ | {"HOME": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("Python is") and "trained weights" in first.stderr and "hits" in first.stderr
    words = re.findall(r"[A-Za-z]+", first.stdout)
    assert len(words) >= 10 and sum(w.lower() in ENGLISH for w in words) >= len(words) // 3  # words, not noise
    assert not os.listdir(tmp_path)  # nothing built, nothing cached: the model ships in the package
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.stdout == first.stdout  # seeded


def test_demo_random_builds_once_and_says_weights_are_random(tmp_path):
    cmd = [sys.executable, "-m", "moestream", "demo", "--random", "--home", str(tmp_path), "--device", "cpu",
           "--max-tokens", "16"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.split()) >= 8  # random words, not broken bytes
    assert "RANDOM weights" in first.stderr and "tok/s" in first.stderr and "hits" in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "building" not in second.stderr
    assert second.stdout == first.stdout  # deterministic: built and sampled the same way
    manifest = tmp_path / "demo-store" / "manifest.json"  # a demo store of an older format is built again
    manifest.write_text(manifest.read_text().replace('"format_version": 2', '"format_version": 1'))
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "building" in third.stderr and third.stdout == first.stdout


def test_chat_keeps_history(tiny):
    proc = subprocess.run([sys.executable, "-m", "moestream", "chat", tiny.store("qwen3_moe"), "--device", "cpu",
                           "--max-tokens", "4"], input="hello\nand again\n/reset\nfresh\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    prompts = [int(line.split()[0].strip("[")) for line in proc.stderr.splitlines() if "prompt tokens" in line]
    assert len(prompts) == 3 and prompts[1] > prompts[0] + prompts[2] // 2  # turn 2 carries turn 1; /reset drops it
    assert "history cleared" in proc.stderr
