"""moestream chat STORE: an interactive chat that keeps the history and uses the model's chat template.

Type a message and press Enter; `/reset` clears the history, `/exit` (or Ctrl-D) quits."""

from __future__ import annotations

import argparse
import sys

from moestream.cli.common import add_engine_args, add_sampling_args, open_llm, sampling_params


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="a system message to start the conversation with")


def run(args: argparse.Namespace) -> int:
    from moestream.engine.stream import TextStream
    from moestream.stats.render import one_line

    params = sampling_params(args)
    llm = open_llm(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    try:
        llm.tokenizer.chat([{"role": "user", "content": "hi"}])  # no chat template: fail before the first turn
        print("chat: /reset clears the history, /exit quits", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(start)
                print("(history cleared)", file=sys.stderr)
                continue
            history.append({"role": "user", "content": text})
            stream = TextStream(llm, llm.tokenizer.chat(history), params)
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            out = stream.output()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": out.text})
            t = out.stats["timings"]
            print(f"[{t['prompt_tokens']} prompt tokens, {t['generated_tokens']} generated at "
                  f"{t['decode_tok_s']:.1f} tok/s; {one_line(out.stats['experts'])}]", file=sys.stderr)
    finally:
        llm.close()
    return 0
