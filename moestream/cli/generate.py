"""moestream generate STORE PROMPT: stream a completion to stdout; timings and a cache summary on stderr."""

from __future__ import annotations

import argparse
import json
import sys

from moestream.cli.common import add_engine_args, add_sampling_args, open_llm, report, sampling_params


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("prompt")
    add_sampling_args(p)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids", "stats"}')
    p.add_argument("--trace-routing", metavar="FILE",
                   help="write every MoE layer's routed experts for each token processed, as JSON lines "
                        "(for `moestream simulate`)")


def run(args: argparse.Namespace) -> int:
    from moestream.engine.stream import TextStream

    params = sampling_params(args)
    trace = open(args.trace_routing, "w") if args.trace_routing else None  # a bad path fails before the load
    llm = open_llm(args)
    try:
        if trace is not None:
            llm.provider.trace(trace)
        tok = llm.tokenizer
        ids = tok.encode(args.prompt) if args.raw else tok.chat([{"role": "user", "content": args.prompt}])
        stream = TextStream(llm, ids, params)
        for piece in stream:
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        out = stream.output()
        if args.json:
            stats = out.stats | {"speculation": llm.stats()["speculation"]}  # this process's one request
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": stats}))
        else:
            sys.stdout.write("\n")
        report(out)
    finally:
        if trace is not None:
            llm.provider.trace(None)  # writes the steps not counted yet
            trace.close()
        llm.close()
    return 0
