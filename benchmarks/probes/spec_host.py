"""The host's work a decode step pays with speculation on at depth 0 (every draft rejected, once adaptive depth has
turned drafts off) against speculation off: the demo model on the CPU with its forward stubbed, so that the figures
are the engine's Python alone. Run on a lent machine beside `verify_cost`, it tells how fast that host runs the
engine against this one (docs/performance.md: a depth-0 step trailed off by ~14 us on an H100's host, where a
development CPU finds ~3.8 us of host work; 2.8 us with steps ahead).

python -m benchmarks.probes.spec_host [--rounds 15] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from moestream.cli.demo import DEMO_STORE
from moestream.engine.decode import Ahead
from moestream.engine.llm import LLM
from moestream.engine.speculation import Depth
from moestream.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tokens", type=int, default=1000)
    args = p.parse_args()
    llm = LLM(DEMO_STORE, device="cpu", dtype="float32", speculation="mtp")
    hidden, logits = torch.zeros(1, llm.config.hidden_size), torch.zeros(1, llm.config.vocab_size)
    logits[0, 5] = 1.0
    llm.decoder.forward = lambda tokens, state, *rest, **options: (hidden.clone(), logits.clone())  # no kernels
    llm.scheduler.ahead = lambda token, state, keep: Ahead(torch.tensor([5]), None, hidden if keep else None)
    prompt, params = list(range(100, 164)), SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    on = llm.engine_config
    arms = {"off": dataclasses.replace(on, speculation="off"), "depth_0": on}
    us: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        for name in list(arms)[:: 1 if round_ % 2 else -1]:  # the order turned each round
            llm.engine_config, llm.depth = arms[name], Depth(on.max_drafts, 0)
            us[name].append(1e6 / llm.generate([prompt], params)[0].stats["timings"]["decode_tok_s"])
    llm.engine_config = on
    row = {name: {"median_us": statistics.median(v), "best_us": min(v)} for name, v in us.items()}
    row["depth_0_minus_off_us"] = {k: row["depth_0"][k] - row["off"][k] for k in ("median_us", "best_us")}
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
