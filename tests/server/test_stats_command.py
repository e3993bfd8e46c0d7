"""`moestream stats` against a running server: summary, per-layer hit rates, the most used experts."""

import json
import subprocess
import sys


def stats_cmd(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moestream", "stats", "--url", url, *args], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_stats_shows_layers_and_experts(tiny, serve):
    server = serve(tiny.store("qwen3_moe"), api_key="k")
    server.client().completions.create(model="tiny", prompt="the expert pool", max_tokens=8)
    layers = stats_cmd(server.url, "layers", "--api-key", "k")
    assert layers.returncode == 0, layers.stderr
    assert "hit rate" in layers.stdout and len([ln for ln in layers.stdout.splitlines() if "q4" in ln]) == 4
    summary = stats_cmd(server.url, "summary", "--api-key", "k")
    assert summary.returncode == 0 and "lookups" in summary.stdout and "resident" in summary.stdout
    experts = stats_cmd(server.url, "experts", "0", "--api-key", "k", "--json")
    assert experts.returncode == 0
    assert sum(json.loads(experts.stdout)[0]["uses"]) > 0


def test_stats_errors_are_one_line(tiny, serve):
    server = serve(tiny.store("qwen3_moe"), api_key="k")
    denied = stats_cmd(server.url)
    assert denied.returncode == 1 and denied.stderr.startswith("error: ") and "api-key" in denied.stderr
    nobody = stats_cmd("http://127.0.0.1:9")
    assert nobody.returncode == 1 and "no moestream server" in nobody.stderr and "Traceback" not in nobody.stderr
