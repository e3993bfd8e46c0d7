"""Mixed-mode decode: Q4 experts in a partial pool and the host tier, misses read at a lower precision (the flagship's
Q2-miss rows), on a store with both record files. Decode tok/s of a few requests, the graph replays and the
counters by precision, as one JSON line (for A/Bs of the mixed launch, docs/performance.md).

python -m benchmarks.probes.mixed_decode STORE [--pool-frac 0.25] [--miss-experts 2] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import random

from benchmarks.common import tier_gb
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--pool-frac", type=float, default=0.25)
    p.add_argument("--miss-experts", type=int, default=2)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    pool_gb, host_gb = tier_gb(args.store, args.pool_frac, True)
    llm = LLM(args.store, pool_gb=pool_gb, host_gb=host_gb, miss_experts=args.miss_experts, max_batch=1)
    rng = random.Random(0)

    def decode_tok_s(tokens: int) -> float:
        prompt = [rng.randrange(llm.config.vocab_size) for _ in range(16)]
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
        return out.stats["timings"]["decode_tok_s"]

    decode_tok_s(8)  # the first request's one-off work
    rates = [decode_tok_s(args.tokens) for _ in range(args.requests)]
    totals = {p: {k: c[k] for k in ("lookups", "hits", "misses")} for p, c in llm.stats()["totals"].items()}
    print(json.dumps({"tag": args.tag, "decode_tok_s": [round(r, 1) for r in rates],
                      "graph_replays": llm.decoder.graph_replays, "totals": totals}))
    llm.close()


if __name__ == "__main__":
    main()
