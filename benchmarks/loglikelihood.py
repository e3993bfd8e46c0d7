"""A multiple-choice loglikelihood task scored by the engine directly, the way lm-evaluation-harness scores it
through the server (`lm_eval --model local-completions`): each choice's continuation tokens summed from the prompt
log probabilities of context + choice; acc takes the likeliest sum, acc_norm the likeliest per character.

  python -m benchmarks.loglikelihood STORE [benchmarks/lm_eval/docs_mc.jsonl]
"""

from __future__ import annotations

import argparse
import json

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's encoding: the context's trailing spaces move to the continuation; the whole text is encoded once
    and the continuation is what follows the context's own tokens. Returns (ids, context length)."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[: len(context) - spaces], context[len(context) - spaces:] + continuation
    whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return whole, len(head)


def score(llm: LLM, docs: list[dict]) -> dict:
    requests = [pair(llm.tokenizer, d["context"], c) for d in docs for c in d["choices"]]
    outs = llm.generate([ids for ids, _ in requests], SamplingParams(max_tokens=1, prompt_logprobs=1))
    sums = [sum(lp for lp, _ in out.prompt_logprobs[ctxlen - 1:]) for out, (_, ctxlen) in zip(outs, requests)]
    acc = norm = 0
    at = 0
    for d in docs:
        s = sums[at: at + len(d["choices"])]
        at += len(d["choices"])
        acc += max(range(len(s)), key=s.__getitem__) == d["label"]
        per_char = [v / len(c) for v, c in zip(s, d["choices"])]
        norm += max(range(len(s)), key=per_char.__getitem__) == d["label"]
    return {"acc": acc / len(docs), "acc_norm": norm / len(docs), "docs": len(docs)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("data", nargs="?", default="benchmarks/lm_eval/docs_mc.jsonl")
    p.add_argument("--prefill-chunk", type=int, default=512, help="as the server's (moestream serve's default)")
    args = p.parse_args()
    with open(args.data) as f:
        docs = [json.loads(line) for line in f]
    llm = LLM(args.store, prefill_chunk=args.prefill_chunk)
    print(json.dumps(score(llm, docs)))
    llm.close()


if __name__ == "__main__":
    main()
