"""What a request pays beyond its tokens, through the public API alone (so it times any checkout): the load
(preload, kernel warm-up and graph capture), then requests in a row on the one loaded engine, each a new prompt
(the first after load against the tenth), and decode rates by answer length (8 against 256 tokens), and the
suite's headline rows (decode 64 tokens after a 16-token prompt; prefill 4096) resident and with a 25% pool and a
host tier. Rows append as JSON lines to --out, labelled, so that two checkouts run back to back compare in one file.

PYTHONPATH=CHECKOUT python -m benchmarks.probes.requests STORE --label new --out rows.jsonl [--only rows]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from moestream.engine.llm import LLM
from moestream.experts.store import open_store
from moestream.sampling import SamplingParams


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _timed(llm: LLM, ids: list[int], new: int) -> dict:
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    t = out.stats["timings"]
    return {"wall_s": time.perf_counter() - start, "prefill_tok_s": t["prefill_tok_s"],
            "decode_tok_s": t["decode_tok_s"]}


def in_a_row(llm: LLM, rng: random.Random, emit) -> None:
    vocab = llm.config.vocab_size
    for i in range(10):
        emit({"row": "request", "index": i + 1, "prompt": 512, "new": 32} | _timed(llm, _ids(rng, 512, vocab), 32))
    for new in (8, 256, 8, 256, 8, 256):
        emit({"row": "answer", "prompt": 16, "new": new} | _timed(llm, _ids(rng, 16, vocab), new))


def headline(llm: LLM, rng: random.Random, emit, pool: str) -> None:
    """The suite's rows after its warm-up (a 64-token prompt, then a first 512-token prompt), three times each."""
    vocab = llm.config.vocab_size
    _timed(llm, _ids(rng, 64, vocab), 4)
    _timed(llm, _ids(rng, 512, vocab), 1)
    for kind, n, new in (("decode", 16, 64), ("prefill", 4096, 1)) * 3:
        r = _timed(llm, _ids(rng, n, vocab), new)
        emit({"row": kind, "pool": pool, "rate": r["decode_tok_s" if kind == "decode" else "prefill_tok_s"]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--label", required=True, help="names this checkout's rows")
    p.add_argument("--out", required=True, help="JSON lines file the rows append to")
    p.add_argument("--only", choices=["requests", "rows"], help="one part (default: both)")
    p.add_argument("--pool", choices=["resident", "25% + host"], help="one pool for the rows (default: both)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    rng = random.Random(0)

    def emit(row: dict) -> None:
        row = {"label": args.label} | row
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    m = open_store(args.store).manifest
    total_gb = m.geometry.num_records * m.layouts["q4"].stride / 1e9
    configs = {"resident": {}, "25% + host": dict(pool_gb=0.25 * total_gb * 1.0001, host_gb=1.01 * total_gb,
                                                  preload=True)}
    for pool, options in configs.items():
        if (args.only == "requests" and pool != "resident") or args.pool not in (None, pool):
            continue
        start = time.perf_counter()
        llm = LLM(args.store, device=args.device, **options)
        emit({"row": "load", "pool": pool, "seconds": time.perf_counter() - start})
        try:
            if pool == "resident" and args.only != "rows":
                in_a_row(llm, rng, emit)
            if args.only != "requests":
                headline(llm, rng, emit, pool)
        finally:
            llm.close()


def summary(path: str) -> str:
    """A table of the rows in `path` by label: medians where a row repeats."""
    rows = [json.loads(line) for line in open(path)]
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        requests = [r for r in mine if r["row"] == "request"]
        if requests:
            out.append(f"{label}: requests in a row (512 in, 32 out), wall s: "
                       + " ".join(f"{r['wall_s']:.2f}" for r in requests))
            for new in (8, 256):
                rates = [r["decode_tok_s"] for r in mine if r["row"] == "answer" and r["new"] == new]
                out.append(f"{label}: {new}-token answers decode at {statistics.median(rates):.1f} tok/s "
                           f"({', '.join(f'{x:.1f}' for x in rates)})")
        for kind in ("decode", "prefill"):
            for pool in dict.fromkeys(r["pool"] for r in mine if r["row"] == kind):
                rates = [r["rate"] for r in mine if r["row"] == kind and r["pool"] == pool]
                out.append(f"{label}: {kind} {pool}: {statistics.median(rates):.1f} tok/s "
                           f"({', '.join(f'{x:.1f}' for x in rates)})")
    return "\n".join(out)


if __name__ == "__main__":
    main()
