"""Greedy decode with steps launched one ahead of the host (Decoder.step_ahead) against steps read one by one, in
one process: a request of each in turn, the order turned each round; tok/s per arm, the paired median of each
round's ratio, and whether both gave the same tokens.

python -m benchmarks.probes.step_ahead STORE [--tokens 256] [--rounds 9] [--pool-gb G --host-gb G]
"""

from __future__ import annotations

import argparse
import json
import statistics

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--pool-gb", type=float)
    p.add_argument("--host-gb", type=float)
    args = p.parse_args()
    tiers = {k: v for k, v in (("pool_gb", args.pool_gb), ("host_gb", args.host_gb)) if v is not None}
    llm = LLM(args.store, **tiers)
    params, prompt = SamplingParams(max_tokens=args.tokens, ignore_eos=True), [5, 6, 7, 8] * 8
    ahead = llm.scheduler.ahead

    def run(on: bool) -> tuple[float, list[int]]:
        llm.scheduler.ahead = ahead if on else None
        out = llm.generate([prompt], params)[0]
        return out.stats["timings"]["decode_tok_s"], out.token_ids

    tokens = {tuple(run(on)[1]) for on in (True, False)}  # also the warm-up
    tok_s: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for on in (True, False) if round_ % 2 else (False, True):
            rate, ids = run(on)
            tok_s[on].append(rate)
            tokens.add(tuple(ids))
    print(json.dumps({"store": args.store, **tiers, "tok_s_ahead": statistics.median(tok_s[True]),
                      "tok_s_one_by_one": statistics.median(tok_s[False]),
                      "ahead_vs_one_by_one_paired": statistics.median(a / b for a, b in zip(tok_s[True], tok_s[False])),
                      "same_tokens": len(tokens) == 1, "launches": llm.decoder.launches}))


if __name__ == "__main__":
    main()
