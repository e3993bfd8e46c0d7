"""A CLI command run in this process, as `python -m moestream ARGS` would run it but without starting an
interpreter and importing torch again (~1.3 s a command on CPU): its exit code and what it printed."""

import contextlib
import io
import subprocess

from moestream.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
