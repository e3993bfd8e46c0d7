"""`moestream` command line: a thin table of subcommands, each a module with `add_args` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

from moestream.errors import MoestreamError

COMMANDS = {
    "pack": "pack a Hugging Face or MLX checkpoint folder into a store",
    "generate": "generate a completion for one prompt",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moestream", description="Run MoE models larger than GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"moestream.cli.{name}")
        module.add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(f"moestream.cli.{args.command}")
    try:
        return module.run(args) or 0
    except MoestreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {e.strerror or e}{': ' + e.filename if e.filename else ''}", file=sys.stderr)
        return 1
