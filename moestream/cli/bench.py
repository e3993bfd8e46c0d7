"""moestream bench STAGE [options]: run a stage of the benchmark suite (benchmarks/suite.py) from a checkout.

The suite lives outside the package (it builds 20 GB stores and runs the peers); this command finds it
in the current directory's `benchmarks/` folder."""

from __future__ import annotations

import argparse
import os
import sys

from moestream.errors import MoestreamError

STAGES = ["stores", "limits", "moestream", "peers", "report"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=STAGES)
    p.add_argument("options", nargs=argparse.REMAINDER, help="passed to benchmarks/suite.py")


def run(args: argparse.Namespace) -> int:
    sys.path.insert(0, os.getcwd())
    try:
        from benchmarks import suite
    except ImportError:
        raise MoestreamError("moestream bench runs benchmarks/suite.py: run it from the repository's top folder") \
            from None
    sys.argv = ["benchmarks.suite", args.stage, *args.options]
    suite.main()
    return 0
