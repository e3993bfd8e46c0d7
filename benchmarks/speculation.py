"""Speculative decoding on the trained demo model (real text): greedy decode tok/s with the MTP head's drafts and
with prompt lookup against none, resident and with a 25% pool + host tier, on two tasks: continuing code, and an
editing task whose answer mostly repeats a text in the prompt. The tokens are checked against speculation off.

  python -m benchmarks.speculation OUT.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics

import torch

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.engine.speculation import SpecStats
from moestream.sampling import SamplingParams

MODULES = ("textwrap", "shlex", "fnmatch", "glob", "bisect", "colorsys")  # Python's own code, wherever it runs
FUNCTIONS = ("shlex.quote", "fnmatch.filter", "colorsys.rgb_to_hsv", "glob.escape", "textwrap.dedent",
             "textwrap.indent")
SETTINGS = {"off": dict(), "mtp": dict(speculation="mtp"), "mtp, 1 draft": dict(speculation="mtp", drafts=1),
            "lookup": dict(speculation="lookup")}


def tasks() -> dict[str, list[str]]:
    """continue: a module's code after its docstring. edit: a function twice, then its first line once more:
    the answer that repeats it is the one the prompt asks for."""
    code = []
    for module in MODULES:
        source = inspect.getsource(__import__(module))
        code.append(source[source.index('"""', source.index('"""') + 3) + 3:].lstrip()[:400])
    edit = []
    for name in FUNCTIONS:
        module, function = name.split(".")
        source = inspect.getsource(getattr(__import__(module), function))
        edit.append(f"{source}\n{source}\n{source.splitlines()[0]}\n")
    return {"continue": code, "edit": edit}


def measure(llm: LLM, prompts: list[str], tokens: int, rounds: int = 3) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def one_by_one():  # one stream at a time: speculation speeds up a single stream
        return [llm.generate([p], params)[0] for p in prompts]

    outs = one_by_one()  # warms the depth too
    tok_s = []
    llm.spec_stats = SpecStats()
    for _ in range(rounds):
        outs = one_by_one()
        t = [o.stats["timings"] for o in outs]
        tok_s.append(sum(x["generated_tokens"] for x in t) / sum(x["decode_seconds"] for x in t))
    spec = llm.spec_stats.as_dict()
    return {"decode_tok_s": statistics.median(tok_s), "tokens": [o.token_ids for o in outs],
            "acceptance": spec["acceptance"], "tokens_per_step": spec["tokens_per_step"], "step_ms": spec["step_ms"],
            "steps_at": spec.get("steps_at")}  # a base tree's stats may lack it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    work, runs = tasks(), []
    for mode in ("resident", "pool 25% + host"):
        base = {}
        for name, setting in SETTINGS.items():
            options = dict(setting)
            if mode != "resident":
                probe = LLM(DEMO_STORE)
                total = probe.provider.pool.stride * probe.provider.geometry.num_records / 1e9
                probe.close()
                options |= dict(pool_gb=0.25 * total * 1.0001, host_gb=total * 1.01)
            llm = LLM(DEMO_STORE, **options)
            for task, prompts in work.items():
                run = {"mode": mode, "speculation": name, "task": task} | measure(llm, prompts, args.tokens)
                if name == "off":
                    base[task] = run
                run["same_tokens"] = run["tokens"] == base[task]["tokens"]
                run["speed_up"] = run["decode_tok_s"] / base[task]["decode_tok_s"]
                totals = llm.stats()["totals"].values()  # since the load
                run["pool_hit_rate"] = sum(t["hits"] for t in totals) / max(1, sum(t["lookups"] for t in totals))
                print(json.dumps({k: v for k, v in run.items() if k != "tokens"}), flush=True)
                runs.append(run)
            llm.close()
            torch.cuda.empty_cache()
    for run in runs:
        del run["tokens"]
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
