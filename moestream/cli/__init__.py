"""`moestream` command line: a thin table of subcommands, each a module with `add_args` and `run`.

Only the chosen command's module is imported, so `moestream --help` and light commands start fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from moestream.errors import MoestreamError

COMMANDS = {
    "pack": "pack a Hugging Face or MLX checkpoint folder into a store",
    "generate": "generate a completion for one prompt",
    "perplexity": "score a text file: perplexity over sliding windows (any expert precision)",
    "chat": "chat in the terminal (keeps history, uses the chat template)",
    "serve": "serve an OpenAI-compatible HTTP API",
    "stats": "show what a running server's expert cache is doing",
    "demo": "build a tiny model, pack it and run it with a pool smaller than the model",
    "bench": "run a stage of the benchmark suite (from a checkout)",
    "simulate": "replay a routing trace through cache policies at several pool sizes",
}


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description="Run MoE models larger than GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(f"moestream.cli.{name}").add_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = _parser(command).parse_args(argv)
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
