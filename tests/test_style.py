"""House rules a machine can check: file size, lint, and the one-way import direction."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moestream"
# Each package may import only itself and the packages listed after it (DESIGN.md section 4).
ALLOWED = {
    "kernels": {"kernels", "quant", "errors", "config", "experts"},
    "experts": {"experts", "quant", "errors", "config", "stats"},
    "quant": {"quant", "errors"},
    "stats": {"stats", "errors"},
    "layers": {"layers", "kernels", "experts", "quant", "errors", "config"},
    "models": {"models", "layers", "kernels", "experts", "quant", "errors", "config"},
    "packer": {"packer", "experts", "quant", "errors", "config"},
}


def test_no_source_file_passes_500_lines():
    big = [f"{p.relative_to(ROOT)} ({n})" for p in ROOT.rglob("*.py") if ".venv" not in p.parts
           and (n := len(p.read_text().splitlines())) > 500]
    assert not big, big


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_ruff_is_clean():
    cmd = [sys.executable, "-m", "ruff", "check", "moestream", "tests", "benchmarks"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_imports_run_one_way():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        owner = parts[0] if len(parts) > 1 else None
        if owner not in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moestream."):
                target = node.module.split(".")[1]
                if target not in ALLOWED[owner]:
                    bad.append(f"{path.relative_to(ROOT)} imports moestream.{target}")
    assert not bad, bad
