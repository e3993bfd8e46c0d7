"""Qwen3.8-Flash-Next's own layers on the decode path: decode tok/s after a short prompt and after one past QSA's
budget (every query then chooses its blocks), and prefill of 4096 tokens, every expert resident: graphed with the
n-gram table on the host tier, the same static step never captured, and graphed with the table on disk (each
step's rows staged before it). Rows append as JSON lines to --out.

python -m benchmarks.probes.flash_next STORE --out rows.jsonl [--configs graph,eager,disk]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams

CONFIGS = {"graph": {}, "eager": dict(decode_mode="eager"), "disk": dict(ngram_tier="disk")}


def _rates(llm: LLM, rng: random.Random, prompt: int, new: int) -> dict:
    ids = [rng.randrange(llm.config.vocab_size) for _ in range(prompt)]
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    t = out.stats["timings"]
    return {"prompt": prompt, "new": new, "wall_s": time.perf_counter() - start, "prefill_tok_s": t["prefill_tok_s"],
            "decode_tok_s": t["decode_tok_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    for name in args.configs.split(","):
        start = time.perf_counter()
        llm = LLM(args.store, **CONFIGS[name])
        load_s = time.perf_counter() - start
        rng = random.Random(0)
        try:
            _rates(llm, rng, 64, 4)
            rows = [_rates(llm, rng, prompt, new) for prompt, new in ((16, 64), (4096, 64), (16, 64), (4096, 64))]
            replays, stats = llm.decoder.graph_replays, llm.stats()
        finally:
            llm.close()
        for r in rows:
            line = {"config": name, "layers": llm.config.num_hidden_layers, "load_s": load_s, "graph_replays": replays,
                    "ngram": stats["ngram"]} | r
            print(json.dumps(line), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
