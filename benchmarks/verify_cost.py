"""What a verify step of k drafts (k+1 rows) costs against a one-row decode step, k = 1..MAX_DRAFTS, resident and with a
25% pool + host tier; and greedy decode with speculation on but every draft wrong (adaptive depth should turn drafts
off) against speculation off and against it on at a depth fixed at 0, a request of each in turn, nine rounds. Random
weights, so drafts are forced: the rows' cost does not depend on whether they are accepted. With `--mtp` the store
has an MTP head, drafts come from it (the all-rejected run pays its steps too), and a head step's own cost is timed:
what a draft costs beside the verify step that checks it; and the whole greedy step of k drafts (drafts,
verification, the head's next draft: one graph) at each fixed k.

  python -m benchmarks.verify_cost OUT.json --geometry qwen3-30b --layers 8 [--mtp]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from benchmarks.synthetic import build
from moestream.config import MAX_DRAFTS
from moestream.engine import generate as gen
from moestream.engine.drafting import HeadDecoder
from moestream.engine.llm import LLM
from moestream.engine.lookup import PromptLookup
from moestream.engine.speculation import Depth, SpecStats
from moestream.experts.format import RecordLayout
from moestream.sampling import SamplingParams


def median_ms(fn, iters: int = 30) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
    return 1e3 * sorted(times)[len(times) // 2]


def step_ms(llm: LLM, rows: int, context: int = 256) -> float:
    """Median ms of a static step of `rows` rows after a `context`-token prompt (graphs where captured)."""
    state = llm.decoder.new_state()
    ids = torch.randint(0, llm.config.vocab_size, (context + rows,)).tolist()
    gen.prefill(llm.model, ids[:context], state, llm.engine_config.prefill_chunk, llm.device)
    return median_ms(lambda: llm.decoder.forward(ids[context:], state))  # not advanced: each writes the same rows


def head_ms(llm: LLM, context: int = 256) -> float:
    """Median ms of the MTP head's one-row static step after `context` positions of its own cache."""
    model, state = llm.model, llm.head.new_state()
    ids = torch.randint(0, llm.config.vocab_size, (context + 1,), device=llm.device)
    hidden = torch.randn(context + 1, model.hidden_width, dtype=llm.dtype, device=llm.device)
    with torch.inference_mode():
        model.draft(hidden[:context], ids[:context], state)  # eager: advances the head's state
    return median_ms(lambda: llm.head.forward(ids[context:].tolist(), state, hidden[context:]))


def reject_every_draft(spec: str, last: int):
    """Make every draft one a random model's greedy run does not pick (the last id); returns the undo. The head
    runs as it would and its logits then point at `last` (on the device: the fused step's drafts too)."""
    if spec == "mtp":
        owner, name, original = HeadDecoder, "_run", HeadDecoder._run

        def replaced(self, *args, **options):
            hidden, logits = original(self, *args, **options)
            return hidden, torch.zeros_like(logits).index_fill_(-1, torch.tensor([last], device=logits.device), 1.0)
    else:
        owner, name, original = PromptLookup, "propose", PromptLookup.propose

        def replaced(self, k):
            return [last - i for i in range(k)]

    setattr(owner, name, replaced)
    return lambda: setattr(owner, name, original)


def fused_ms(llm: LLM, tokens: int = 64) -> dict[int, float]:
    """ms a greedy MTP step of k drafts takes whole (engine/drafting.py FusedDrafts, host work included), from the
    speculation counters of a run at each fixed depth (drafts rejected or not, a step of k drafts costs the same)."""
    ms = {}
    for k in range(1, MAX_DRAFTS + 1):
        llm.depth, llm.spec_stats = Depth(llm.engine_config.max_drafts, k), SpecStats()
        for _ in range(2):  # the first captures the step's graph
            llm.generate([prompt_of(llm)], SamplingParams(max_tokens=tokens, ignore_eos=True))
        ms[k] = llm.spec_stats.as_dict()["step_ms"][k]
    llm.depth = Depth(llm.engine_config.max_drafts, llm.engine_config.drafts)
    return ms


def prompt_of(llm: LLM) -> list[int]:
    return [i % llm.config.vocab_size for i in range(1000, 1064)]


def decode_tok_s(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return llm.generate([prompt_of(llm)], params)[0].stats["timings"]["decode_tok_s"]


def all_rejected(llm: LLM, spec: str, rounds: int = 9, tokens: int = 128) -> dict:
    """Greedy decode with speculation on and every draft rejected against speculation off, and against it on at a
    depth fixed at 0 (what its bookkeeping alone costs), a request of each a round, interleaved so that the
    machine's drift falls on all, the arms' order turned a place each round so that none always runs first; the
    depth carries over from round to round as from request to request (the first round's pays its early drafts):
    each round's tok/s, the medians, the median of each round's rejected / off (paired: drift within a lease moves
    a round's arms together), and the counters of the rounds with drafts."""
    on_config, off_config = llm.engine_config, dataclasses.replace(llm.engine_config, speculation="off")
    depth, stats = llm.depth, SpecStats()

    def rejected() -> float:
        undo = reject_every_draft(spec, llm.config.vocab_size - 1)
        llm.depth, llm.spec_stats = depth, stats
        try:
            return decode_tok_s(llm, tokens)
        finally:
            undo()

    def depth_0() -> float:
        llm.depth, llm.spec_stats = Depth(depth.max_drafts, 0), SpecStats()
        return decode_tok_s(llm, tokens)

    def off() -> float:
        llm.engine_config = off_config
        try:
            return decode_tok_s(llm, tokens)
        finally:
            llm.engine_config = on_config

    arms = {"all_rejected": rejected, "depth_0": depth_0, "off": off}
    tok_s = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            tok_s[name].append(arms[name]())
    llm.depth, llm.spec_stats = depth, stats
    return {"decode_tok_s_spec_all_rejected": statistics.median(tok_s["all_rejected"]),
            "decode_tok_s_spec_off": statistics.median(tok_s["off"]),
            "decode_tok_s_spec_depth_0": statistics.median(tok_s["depth_0"]),
            "all_rejected_vs_off_paired": statistics.median(a / o for a, o in zip(tok_s["all_rejected"], tok_s["off"])),
            "rounds_tok_s": tok_s, "speculation": stats.as_dict()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--geometry", default="qwen3-30b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--work", default="/tmp/verify-cost")
    p.add_argument("--mtp", action="store_true", help="drafts from the store's MTP head (built with one)")
    args = p.parse_args()
    spec = "mtp" if args.mtp else "lookup"
    path = os.path.join(args.work, f"{args.geometry}-{args.layers}" + ("-mtp" if args.mtp else ""))
    # flash-next: a small n-gram table and Q4 records as holes (zero experts, computed like any), quick to write
    extra = dict(ngram_vocab_size_base=100_000, sparse=("q4",)) if "flash" in args.geometry else {}
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        build(path, args.geometry, layers=args.layers, mtp=args.mtp, **extra)
    runs = []
    for mode in ("resident", "pool 25% + host"):
        llm = LLM(path, speculation=spec)  # drafts chosen per step, up to MAX_DRAFTS: every row count captured
        if mode != "resident":
            g = llm.store.manifest.geometry
            total = g.num_records * RecordLayout.build("q4", g.hidden_size, g.intermediate_size).stride / 1e9
            llm.close()
            llm = LLM(path, speculation=spec, pool_gb=0.25 * total * 1.0001, host_gb=total * 1.01)
        ms = {rows: step_ms(llm, rows) for rows in range(1, MAX_DRAFTS + 2)}
        run = {"geometry": args.geometry, "layers": args.layers, "mode": mode,
               "step_ms": ms, "relative": {k: ms[k + 1] / ms[1] for k in range(1, MAX_DRAFTS + 1)}}
        if args.mtp:
            run["head_ms"] = head_ms(llm)
            run["fused_step_ms"] = fused_ms(llm)
        run.update(all_rejected(llm, spec))  # rejected verify steps are paid until the depth falls to 0
        run["graph_rows"] = sorted(llm.decoder.graphs)
        print(json.dumps(run), flush=True)
        runs.append(run)
        llm.close()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
