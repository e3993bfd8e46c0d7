"""A whole long prompt's attention through cuDNN (padded to a multiple of PAD_TO) against flash attention, in one
process and interleaved: resident prefill tok/s at each length, and whether both arms give the same tokens.

python -m benchmarks.probes.long_attention STORE [--lengths 4096,3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import moestream.layers.attention as attention
from benchmarks.probes.e2e import prompt
from moestream.engine.llm import LLM
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams

ARMS = {"flash": 10 ** 9, "cudnn": attention.PAD_TO}  # PAD_TO past every prompt sends it to flash


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--lengths", default="4096,3000")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    s = open_store(args.store)
    llm = LLM(args.store, device="cuda", pool_gb=s.manifest.geometry.num_records * s.manifest.layouts["q4"].stride
              / 1e9, preload=False)
    for n in map(int, args.lengths.split(",")):
        ids = prompt(n, llm.config.vocab_size, seed=n)
        rates, tokens = {arm: [] for arm in ARMS}, {}
        for r in range(args.rounds + 1):  # the first round is not counted
            for arm in (ARMS if r % 2 else reversed(ARMS)):
                attention.PAD_TO = ARMS[arm]
                out = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
                rates[arm] += [out.stats["timings"]["prefill_tok_s"]] if r else []
                tokens[arm] = out.token_ids
        median = {arm: statistics.median(v) for arm, v in rates.items()}
        print({"prompt": n, **{arm: round(m) for arm, m in median.items()},
               "cudnn_vs_flash": round(median["cudnn"] / median["flash"], 3),
               "same_tokens": tokens["flash"] == tokens["cudnn"]}, flush=True)
    attention.PAD_TO = ARMS["cudnn"]


if __name__ == "__main__":
    main()
