"""Serving under load: N concurrent streaming clients against the real HTTP server (`moestream serve`, its own
process), each sending its requests back to back, prompt and output lengths drawn from a fixed seed. Per N:
aggregate output tok/s, time to first token and inter-token latency (p50/p99), and how long /health and /metrics
took to answer meanwhile, and the engine's steps in that run (from /v1/stats: those that fed prompt tokens and the
others, their mean ms and how many took past each bound); at the end, its decode steps by batch size. A plot of
aggregate tok/s against N beside the JSON.

  python -m benchmarks.serving STORE OUT.json [--clients 1,2,4,8,16,32] [--requests 2] [--pool-frac 0.25 --host]
      [-- SERVE OPTIONS...]
  python -m benchmarks.serving --plot OUT.png RUN.json...
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time

from benchmarks.common import machine, tier_gb
from moestream.engine.scheduler import STEP_BUCKETS
from moestream.experts.store import open_store

PROMPT_TOKENS, OUTPUT_TOKENS = (32, 512), (64, 192)


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else (values or [0.0])[0]


class Client:
    def __init__(self, port: int):
        self.port = port

    def get(self, path: str) -> tuple[float, bytes]:
        tic = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("GET", path)
        body = conn.getresponse().read()
        conn.close()
        return time.perf_counter() - tic, body

    def complete(self, prompt: list[int], tokens: int) -> dict:
        """One streaming completion: when each text chunk arrived, and the usage."""
        body = json.dumps({"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        arrivals, usage = [], None  # (when, tokens so far) of each text chunk
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if event["choices"] and event["choices"][0]["text"]:
                arrivals.append((time.perf_counter(), usage["completion_tokens"]))
        conn.close()
        return {"start": start, "arrivals": arrivals, "tokens": usage["completion_tokens"]}


def load(client: Client, clients: int, requests: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    work = [[([rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))], rng.randint(*OUTPUT_TOKENS))
             for _ in range(requests)] for _ in range(clients)]
    done: list[dict] = []
    probes: list[float] = []
    running = threading.Event()
    running.set()

    def one(jobs):
        for prompt, tokens in jobs:
            done.append(client.complete(prompt, tokens))

    def probe():
        while running.is_set():
            probes.append(max(client.get("/health")[0], client.get("/metrics")[0]))
            time.sleep(0.2)

    threads = [threading.Thread(target=one, args=(jobs,)) for jobs in work]
    prober = threading.Thread(target=probe)
    start = time.perf_counter()
    prober.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    running.clear()
    prober.join()
    # a chunk holds the text of every token since the last (a character's bytes may span tokens): its gap is
    # spread over them
    gaps = [(b - a) / (m - n) for r in done for (a, n), (b, m) in zip(r["arrivals"], r["arrivals"][1:])
            for _ in range(m - n)]
    ttft = [r["arrivals"][0][0] - r["start"] for r in done if r["arrivals"]]
    tokens = sum(r["tokens"] for r in done)
    return {"clients": clients, "requests": len(done), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "itl_p50_ms": 1e3 * quantile(gaps, 0.5), "itl_p99_ms": 1e3 * quantile(gaps, 0.99),
            "probe_p99_ms": 1e3 * quantile(probes, 0.99), "probe_max_ms": 1e3 * max(probes, default=0.0)}


def step_delta(before: dict, after: dict) -> dict:
    """Engine steps taken between two reads of `stats()["steps"]` (via /v1/stats): per kind ("prompt": steps that fed
    prompt tokens, "decode": the others), how many, their mean ms, and how many took past each bucket's bound."""
    out = {}
    for kind, now in after.items():
        counts = [a - b for a, b in zip(now["counts"], before[kind]["counts"])]
        total, seconds = sum(counts), now["seconds"] - before[kind]["seconds"]
        out[kind] = {"steps": total, "mean_ms": 1e3 * seconds / total if total else 0.0,
                     "over": {bound: sum(counts[i + 1:]) for i, bound in enumerate(STEP_BUCKETS)}}
    return out


def engine_steps(client: Client) -> dict:
    return json.loads(client.get("/v1/stats")[1])["engine"]["steps"]


def decode_steps_by_batch(metrics: bytes) -> dict[int, int]:
    out = {}
    for line in metrics.decode().splitlines():
        if line.startswith("moestream_decode_steps_total{"):
            batch = int(line.split('batch="')[1].split('"')[0])
            out[batch] = int(float(line.rsplit(" ", 1)[1]))
    return out


def plot(runs: list[dict], path: str) -> None:
    """Aggregate tok/s against the clients, a line a run."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for run in runs:
        rows = run["rows"]
        ax.plot([r["clients"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=run["label"])
    ax.set(xscale="log", xlabel="concurrent streaming clients", ylabel="aggregate output tok/s")
    ax.set_xticks([r["clients"] for r in runs[0]["rows"]], [str(r["clients"]) for r in runs[0]["rows"]])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tier_options(store: str, pool_frac: float | None, host: bool) -> list[str]:
    """`moestream serve` options for a pool of `pool_frac` of the store's expert records (the rest in the host tier
    with `host`), sized as benchmarks/batching.py sizes them (common.tier_gb)."""
    pool_gb, host_gb = tier_gb(store, pool_frac, host)
    pool = ["--pool-gb", f"{pool_gb:.9g}"] if pool_gb is not None else []
    return pool + (["--host-gb", f"{host_gb:.9g}"] if host else [])


def main() -> None:
    if sys.argv[1:2] == ["--plot"]:  # --plot OUT.png RUN.json...: the runs on one plot
        plot([json.load(open(path)) for path in sys.argv[3:]], sys.argv[2])
        return
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--clients", default="1,2,4,8,16,32")
    p.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--label", default="")
    p.add_argument("--pool-frac", type=float, help="a GPU pool of this fraction of the experts (default: the server's)")
    p.add_argument("--host", action="store_true", help="the rest of the experts in the pinned host tier")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, options = p.parse_args(argv[:cut]), argv[cut + 1:]  # after --: options for `moestream serve`
    options = tier_options(args.store, args.pool_frac, args.host) + options
    server = subprocess.Popen([sys.executable, "-m", "moestream", "serve", args.store, "--port", str(args.port),
                               "--max-queue", "256", "--log-level", "warning", *options])
    client = Client(args.port)
    try:
        while True:  # the port is bound before the model loads: a request waits for the app
            try:
                if b'"ok"' in client.get("/health")[1]:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(0.5)
        vocab = open_store(args.store).model.vocab_size
        client.complete([1, 2, 3], 4)  # the first request's one-time costs
        rows = []
        for n in (int(c) for c in args.clients.split(",")):
            before = engine_steps(client)
            rows.append(load(client, n, args.requests, vocab, seed=n))
            rows[-1]["engine_steps"] = step_delta(before, engine_steps(client))
            print(json.dumps(rows[-1]), flush=True)
        steps = decode_steps_by_batch(client.get("/metrics")[1])
    finally:
        server.terminate()
        server.wait(60)
    result = {"machine": machine(), "store": args.store, "options": options, "label": args.label, "rows": rows,
              "decode_steps_by_batch": steps}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot([result], args.out.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
