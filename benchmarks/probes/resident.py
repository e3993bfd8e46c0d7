"""Every expert of a store resident: prefill tok/s at each prompt length (the median of --rounds after a warm run),
one stream's graph decode, and the tokens each gives, as one JSON line (device.sh ab-prefill runs it in a base tree
and this one, interleaved); with --profile N, a prefill of N tokens by kernel; with --trace N, where the GPU waits
in a prefill of N tokens (`e2e.gaps`: before its first kernel, between kernels, after its last).

python -m benchmarks.probes.resident STORE [--tag T] [--lengths 512,4096] [--rounds 7] [--profile 4096] [--trace 4096]
    [--prefill-graph-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.common import out_dir, tier_gb
from benchmarks.probes.e2e import gaps, profile_prefill, prompt, traced
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--tag", default="")
    p.add_argument("--lengths", default="512,4096")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", type=int, default=0, help="also print a prefill of this many tokens by kernel")
    p.add_argument("--trace", type=int, default=0, help="also trace a prefill of this many tokens: where the GPU waits")
    p.add_argument("--prefill-graph-tokens", type=int, help="the engine's (default: its own; a base tree may lack it)")
    args = p.parse_args()
    graphs = {"prefill_graph_tokens": args.prefill_graph_tokens} if args.prefill_graph_tokens else {}
    llm = LLM(args.store, device="cuda", pool_gb=tier_gb(args.store, 1.0, False)[0], preload=False, **graphs)
    row, tokens = {"tag": args.tag}, {}
    for n in map(int, args.lengths.split(",")):
        ids = prompt(n, llm.config.vocab_size, seed=n)
        tokens[n] = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids  # and warm
        rates = [llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0].stats["timings"]
                 ["prefill_tok_s"] for _ in range(args.rounds)]
        row[f"prefill_{n}_ms"] = round(n / statistics.median(rates) * 1e3, 2)
        row[f"prefill_{n}_tok_s"] = round(statistics.median(rates))
    ids = prompt(16, llm.config.vocab_size)
    llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
    rates = [llm.generate([ids], SamplingParams(max_tokens=128, ignore_eos=True))[0].stats["timings"]["decode_tok_s"]
             for _ in range(3)]
    decode = statistics.median(rates)
    row |= {"decode_step_ms": round(1e3 / decode, 3), "decode_tok_s": round(decode, 1), "tokens": tokens}
    print(json.dumps(row), flush=True)
    if args.profile:
        profile_prefill(llm, args.profile)
    if args.trace:
        path = os.path.join(out_dir("resident"), f"prefill-{args.trace}.json")
        ids = prompt(args.trace, llm.config.vocab_size, seed=args.trace)
        llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        with traced(path):
            llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        print(json.dumps({"trace": args.trace, **gaps(path + ".gz")}), flush=True)


if __name__ == "__main__":
    main()
