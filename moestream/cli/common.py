"""Options shared by the commands that run a model (generate, chat, serve, bench)."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder written by `moestream pack`")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when a GPU is present, else cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--pool-gb", type=float, help="GPU expert pool in decimal GB (default: from free memory)")
    p.add_argument("--host-gb", type=float, default=0.0, help="pinned host-RAM expert tier in GB (default 0: off)")
    p.add_argument("--experts", type=int, default=4, choices=[4, 3, 2, 16], help="expert precision (default 4)")
    p.add_argument("--miss-experts", type=int, choices=[3, 2],
                   help="with --experts 4: fetch demand and ring misses at 3 or 2 bits (pool fills stay 4-bit)")
    p.add_argument("--ring", type=int, default=64, help="prefill ring slots (default 64)")
    p.add_argument("--group", type=int, default=16, help="experts per ring batch (default 16)")
    p.add_argument("--no-lookahead", action="store_true", help="do not prefetch the next layer's experts")
    p.add_argument("--no-ring-lookahead", action="store_true",
                   help="prefill: do not start the next layer's ring copies before this layer is done")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from moestream.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          stop=tuple(args.stop))


def open_llm(args: argparse.Namespace, **options):
    """The `LLM` the engine options ask for; `options` go to `LLM` as they are (serve: prefix cache)."""
    from moestream.engine.llm import LLM

    return LLM(args.store, device=args.device, dtype=args.dtype, pool_gb=args.pool_gb, host_gb=args.host_gb,
               experts=args.experts, miss_experts=args.miss_experts, ring_slots=args.ring, ring_group=args.group,
               lookahead=not args.no_lookahead, ring_lookahead=not args.no_ring_lookahead, **options)


def report(out, seconds: float | None = None) -> None:
    """A request's timings and what the expert cache did, on stderr."""
    import sys

    from moestream.stats.render import one_line

    t = out.stats["timings"]
    tail = f"; {seconds:.1f} s in all" if seconds is not None else f" ({out.finish_reason})"
    print(f"prompt {t['prompt_tokens']} tokens at {t['prefill_tok_s']:.1f} tok/s, generated "
          f"{t['generated_tokens']} at {t['decode_tok_s']:.1f} tok/s{tail}", file=sys.stderr)
    print(one_line(out.stats["experts"]), file=sys.stderr)
