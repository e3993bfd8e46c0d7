"""What low-bit experts cost in accuracy: per mode, the mean relative logit error against the Q4 model and
the greedy agreement rate over a fixed set of prompts (token by token, teacher-forced on Q4's tokens).

python -m benchmarks.probes.lowbit_accuracy STORE [--prompts 16] [--tokens 32]
(STORE needs q4; q3/q2 are derived on first use.)
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.common import out_dir, write
from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams

MODES = {"q3": dict(experts=3), "q2": dict(experts=2), "q4 + q3 misses": dict(experts=4, miss_experts=3),
         "q4 + q2 misses": dict(experts=4, miss_experts=2)}


def prompts(vocab: int, n: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def trace(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.logits(ids).float()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default=None)
    p.add_argument("--pool-gb", type=float, help="pool size (mixed modes need a pool below the model)")
    args = p.parse_args()
    base = LLM(args.store, device=args.device, experts=4)
    sets = prompts(base.config.vocab_size, args.prompts)
    # Q4's greedy continuations, then every mode scored teacher-forced on the same sequences
    seqs = [s + base.generate([s], SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0].token_ids for s in sets]
    ref = [trace(base, s) for s in seqs]
    base.close()
    table, data = [], {}
    for name, opts in MODES.items():
        llm = LLM(args.store, device=args.device, pool_gb=args.pool_gb, **opts)
        errs, agree, total = [], 0, 0
        for s, r in zip(seqs, ref):
            got = trace(llm, s)
            errs.append(((got - r).norm(dim=-1) / r.norm(dim=-1)).mean().item())
            agree += (got.argmax(-1) == r.argmax(-1)).sum().item()
            total += r.shape[0]
        llm.close()
        data[name] = {"mean_rel_logit_error": sum(errs) / len(errs), "greedy_agreement": agree / total}
        table.append([name, f"{data[name]['mean_rel_logit_error']:.3f}", f"{data[name]['greedy_agreement']:.1%}"])
    write(out_dir("lowbit-accuracy"), "lowbit_accuracy", {"store": args.store, "modes": data}, table,
          ["mode", "mean relative logit error vs Q4", "greedy agreement with Q4"])


if __name__ == "__main__":
    main()
