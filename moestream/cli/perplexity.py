"""moestream perplexity STORE FILE: the model's perplexity on a text file (llama.cpp's `llama-perplexity`).

The file is tokenized raw (no chat template) and scored in windows of --ctx tokens advancing by --stride, each a fresh
sequence: the first window scores all its tokens but the first, every later one only the tokens past the previous
window's end (a window's own first token has no context in it; with --stride below --ctx every token but the
file's first is scored exactly once). A human line goes to stderr; stdout gets the perplexity, or with --json one
summary object."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from moestream.cli.common import add_engine_args, open_llm
from moestream.errors import MoestreamError, RequestError

ROWS_PER_CHUNK = 64  # logit rows turned float64 at a time: [64, vocab] stays small next to a full expert pool


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("file", help="UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=int, default=256, help="tokens each window advances (default 256; at most --ctx)")
    p.add_argument("--max-tokens", type=int, help="read only the file's first N tokens (for a quick run)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object {"perplexity", "nll_per_token", "tokens_scored", "windows", ...}')


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MoestreamError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoestreamError(f"{path} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    if not text.strip():
        raise MoestreamError(f"{path} is empty")
    return text


def windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over `n` tokens; the scored spans tile [1, n)."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


def window_nll(logits, ids, first: int) -> float:
    """Summed NLL (float64) of tokens ids[first:] given logits [T, vocab] of ids (row t predicts token t + 1)."""
    import torch

    total = 0.0
    targets = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
    for start in range(first, len(ids), ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, len(ids))
        rows = logits[start - 1:stop - 1].double()  # [rows, vocab]
        picked = rows.gather(1, targets[start:stop, None])[:, 0]
        total += (torch.logsumexp(rows, -1) - picked).sum().item()
    return total


def check_args(args: argparse.Namespace) -> None:
    if args.ctx < 2:
        raise RequestError(f"--ctx {args.ctx}: a window needs at least 2 tokens")
    if not 1 <= args.stride <= args.ctx:
        raise RequestError(f"--stride {args.stride}: need 1 <= --stride <= --ctx ({args.ctx}), or tokens go unscored")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise RequestError(f"--max-tokens {args.max_tokens}: need at least 2 tokens to score one")


def run(args: argparse.Namespace) -> int:
    from moestream.engine.progress import progress_bar
    from moestream.stats.counters import delta
    from moestream.stats.render import one_line

    check_args(args)
    text = read_text(args.file)  # before the load: a bad file is refused at once
    llm = open_llm(args)
    try:
        context = llm.context_length
        if context is not None and args.ctx > context:
            raise RequestError(f"--ctx {args.ctx} is above this model's context ({context} tokens)")
        ids = llm.tokenizer.encode(text)[:args.max_tokens]
        if len(ids) < 2:
            raise MoestreamError(f"{args.file} is too short: {len(ids)} token, and perplexity needs at least 2")
        spans = windows(len(ids), args.ctx, args.stride)
        before = llm.provider.totals()
        nll, scored = 0.0, 0
        start = time.perf_counter()
        with progress_bar("perplexity", len(spans)) as advance:
            for i, (begin, end, first) in enumerate(spans):
                window = ids[begin:end]
                nll += window_nll(llm.logits(window), window, first - begin)
                scored += end - first
                advance(i + 1)
        seconds = time.perf_counter() - start
        experts = delta(before, llm.provider.totals())
    finally:
        llm.close()
    expert = llm.engine_config.expert
    summary = {"perplexity": math.exp(nll / scored), "nll_per_token": nll / scored, "tokens_scored": scored,
               "windows": len(spans), "ctx": args.ctx, "stride": args.stride, "precision": expert.precision,
               "miss_precision": expert.miss_precision, "seconds": seconds, "tok_s": scored / seconds,
               "experts": experts}
    misses = f", misses {expert.miss_precision}" if expert.miss_precision else ""
    plural = "s" if len(spans) != 1 else ""
    print(f"perplexity {summary['perplexity']:.4f} over {scored} tokens ({len(spans)} window{plural} of {args.ctx}, "
          f"stride {args.stride}) at {summary['tok_s']:.1f} tok/s; experts {expert.precision}{misses}", file=sys.stderr)
    print(one_line(experts), file=sys.stderr)
    print(json.dumps(summary) if args.json else f"{summary['perplexity']:.4f}")
    return 0
