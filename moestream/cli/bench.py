"""moestream bench STAGE [options]: run a stage of the benchmark suite (benchmarks/suite.py).

The suite lives outside the package (it builds 20 GB stores and runs the peers): it is the `benchmarks/` folder
of the source checkout this package was installed from (`pip install -e .`), found from any working folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import moestream
from moestream.errors import MoestreamError

STAGES = ["stores", "limits", "moestream", "peers", "llamacpp", "report"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=STAGES)
    p.add_argument("options", nargs=argparse.REMAINDER, help="passed to benchmarks/suite.py")


def checkout() -> Path:
    """The source checkout beside the installed package; an installed wheel has no benchmarks/ beside it."""
    root = Path(moestream.__file__).resolve().parents[1]
    if not (root / "benchmarks" / "suite.py").is_file():
        raise MoestreamError("the benchmark suite ships with the source checkout, not the package: clone the "
                             "repository and install it with `pip install -e .`, then run `moestream bench` again")
    return root


def run(args: argparse.Namespace) -> int:
    root = str(checkout())
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import suite

    sys.argv = ["moestream bench", args.stage, *args.options]
    suite.main()
    return 0
