"""`moestream bench` finds the checkout's benchmarks/ from any working folder (CPU, no stores)."""

import subprocess
import sys


def bench(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moestream", "bench", *args], cwd=cwd, capture_output=True, text=True)


def test_help_runs_outside_the_checkout(tmp_path):
    proc = bench(tmp_path, "report", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--work" in proc.stdout


def test_report_without_results_is_one_clear_line(tmp_path):
    proc = bench(tmp_path, "report", "--out", str(tmp_path / "empty"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: no suite.json in {tmp_path / 'empty'}: run the suite's "
                                                "stages first, or pass --out with one"]
