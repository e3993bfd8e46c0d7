"""How far `--cpu-experts` moves results (issue 34's exactness figures): the same prompts prefilled and decoded
greedily with the host CPU computing every ring miss it can (`all`) and with none (`off`), pool 25% + a host tier
holding every record. Prints, per prompt, the prompt logits' relative error and the greedy tokens' agreement.

python -m benchmarks.probes.cpu_experts_exactness [STORE] [--device cuda] [--new 64] [--out rows.json]
(STORE: default the demo model, prompts cut from its own README-style text)
"""

from __future__ import annotations

import argparse
import json

import torch

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.experts.store import open_store

PROMPTS = (
    "def read_config(path):\n    \"\"\"Read a configuration file and return a dictionary of its settings.\n\n"
    "    The file is parsed line by line; blank lines and comments are skipped.\n    \"\"\"\n    settings = {}\n",
    "The kernel's memory manager keeps a list of free pages for each zone. When a process asks for memory, the "
    "allocator first looks in the per-CPU lists, then in the zone's free areas, and only then",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description='Copy files')\n"
    "    parser.add_argument('source')\n    parser.add_argument('target')\n    args = parser.parse_args(argv)\n",
    "A dictionary is a mapping from keys to values. In Python, dictionaries keep the order in which keys were "
    "inserted, and looking a key up takes constant time on average. The following example",
)


def run(llm: LLM, ids: list[int], new: int) -> tuple[torch.Tensor, list[int]]:
    """(the prompt's logits [T, vocab], `new` greedy tokens)."""
    state = llm.decoder.new_state()
    with torch.inference_mode():
        logits = llm.model.logits(llm.model(torch.tensor(ids, device=llm.device), state)).float().cpu()
    tokens, last = [], logits[-1]
    for _ in range(new):
        tokens.append(int(torch.argmax(last)))
        last = llm.decoder.step(tokens[-1], state).float().cpu()
    return logits, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store", nargs="?", default=DEMO_STORE)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args()
    store = open_store(args.store)
    g, stride = store.manifest.geometry, store.manifest.layouts["q4"].stride
    total_gb = g.num_records * stride / 1e9
    runs = {}
    for mode in ("off", "all"):
        llm = LLM(args.store, device=args.device, pool_gb=total_gb * 0.25 * 1.0001, host_gb=total_gb * 1.01,
                  preload=True, cpu_experts=mode)
        try:
            prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
            runs[mode] = [run(llm, ids, args.new) for ids in prompts]
            totals = llm.stats()["totals"]["q4"]
            print(f"{mode}: {totals['cpu_records']} records on the CPU, {totals['reads']['host']['records']} copied")
        finally:
            llm.close()
    rows = []
    for (ref_logits, ref_tokens), (logits, tokens) in zip(runs["off"], runs["all"]):
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(tokens))
        rows.append({"prompt_tokens": ref_logits.shape[0],
                     "logit_rel_err": float((logits - ref_logits).norm() / ref_logits.norm()),
                     "logit_max_abs_err": float((logits - ref_logits).abs().max()),
                     "argmax_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                     "greedy_same_prefix": same, "greedy_tokens": len(tokens)})
        print(json.dumps(rows[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"store": args.store, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
