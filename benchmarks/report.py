"""The suite's report: per model, a markdown table with moestream's figure beside each peer's and the bound
in every scenario, issue 7's targets checked, and PNG plots (tok/s against pool size with the bound drawn
in; hit rate per layer)."""

from __future__ import annotations

import json
import os

PEERS = ("transformers (GPU)", "transformers + accelerate (experts on CPU)", "llama.cpp (GPU)",
         "llama.cpp --n-cpu-moe 36", "llama.cpp --n-cpu-moe 36 --repack 0")
HEADER = ["scenario", "pool", "host tier", "engine", "tok/s", "bound", "of bound", *PEERS]


def _model(run: dict) -> str:
    return run.get("model", "qwen3-30b")  # the first suites' peer rows name no model: they ran on 30B


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}" if x < 10 else f"{x:,.1f}"


def table(runs: list[dict], model: str) -> list[str]:
    peers = {(r["engine"], r["scenario"], r["tokens"]): r["rate"] for r in runs
             if r["engine"] in PEERS and _model(r) == model}
    ours = sorted((r for r in runs if r["engine"] not in PEERS and _model(r) == model),
                  key=lambda r: (r["scenario"], r["tokens"], -r["pool"], r["host_tier"], r["engine"]))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in ours:
        bound = None if r.get("bound_invalid") else r.get("bound")
        cells = [f"{r['scenario']} {r['tokens']}", f"{r['pool']:.0%}", "on" if r["host_tier"] else "off", r["engine"],
                 _fmt(r["rate"]), "invalid" if r.get("bound_invalid") else _fmt(bound),
                 f"{r['rate'] / bound:.0%}" if bound else "-",
                 *(_fmt(peers.get((p, r["scenario"], r["tokens"]))) for p in PEERS)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(runs: list[dict]) -> list[str]:
    """Issue 7's targets for the 30B geometry, each with the figure that meets or misses it."""
    def pick(*key, engine="moestream"):  # (scenario, tokens, pool, host tier)
        return next((r for r in runs if _model(r) == "qwen3-30b" and r["engine"] == engine
                     and (r["scenario"], r["tokens"], r["pool"], r["host_tier"]) == key), None)

    def share(r):
        return r["rate"] / r["bound"] if r and r.get("bound") and not r.get("bound_invalid") else None

    rows = [("decode, whole model resident", pick("decode", 16, 1.0, False), 150, lambda r: r["rate"], "tok/s"),
            ("decode, pool 25%, host tier", pick("decode", 16, 0.25, True), 0.8, share, "of H2D bound"),
            ("prefill 4096, pool 25%, host tier", pick("prefill", 4096, 0.25, True), 0.7, share, "of bound")]
    ring_variants = sorted({r["engine"] for r in runs if _model(r) == "qwen3-30b" and "ring" in r["engine"]})
    rows += [(f"prefill 4096, pool 25%, host tier ({engine.removeprefix('moestream, ')})",
              pick("prefill", 4096, 0.25, True, engine=engine), 0.7, share, "of bound") for engine in ring_variants]
    rows += [(f"{s} {n}, pool {p:.0%}, disk only", pick(s, n, p, False), 0.8, share, "of disk bound")
             for s, n in (("decode", 16), ("prefill", 512), ("prefill", 4096)) for p in (0.5, 0.25)]
    lines = ["| target | figure | goal | met |", "|---|---|---|---|"]
    for name, r, goal, value, unit in rows:
        v = value(r) if r else None
        shown = "-" if v is None else (f"{v:.1f} {unit}" if unit == "tok/s" else f"{v:.1%} {unit}")
        goal_shown = f">= {goal} {unit}" if unit == "tok/s" else f">= {goal:.0%}"
        lines.append(f"| {name} | {shown} | {goal_shown} | {'-' if v is None else 'yes' if v >= goal else 'no'} |")
    return lines


def against_llamacpp(runs: list[dict], model: str) -> list[str]:
    """Issue 32: each moestream row beside the best llama.cpp variant of the same scenario, pool and host tier."""
    def key(r):
        return r["scenario"], r["tokens"], r["pool"], r["host_tier"]

    peers: dict[tuple, dict] = {}
    for r in (r for r in runs if r["engine"].startswith("llama.cpp") and _model(r) == model):
        if r["rate"] > peers.get(key(r), {}).get("rate", 0):
            peers[key(r)] = r
    lines = ["| scenario | pool | host tier | moestream | llama.cpp | ratio | ahead |", "|" + "---|" * 7]
    for r in sorted((r for r in runs if r["engine"] == "moestream" and _model(r) == model and key(r) in peers),
                    key=lambda r: (r["scenario"], r["tokens"], -r["pool"])):
        peer = peers[key(r)]
        lines.append(f"| {r['scenario']} {r['tokens']} | {r['pool']:.0%} | {'on' if r['host_tier'] else 'off'} | "
                     f"{_fmt(r['rate'])} | {_fmt(peer['rate'])} ({peer['engine']}) | {r['rate'] / peer['rate']:.2f}x | "
                     f"{'yes' if r['rate'] >= peer['rate'] else 'no'} |")
    return lines if len(lines) > 2 else []


def low_bit(runs: list[dict]) -> list[str]:
    """Issue 8: bytes moved (host + disk) per token and tok/s of each low-bit mode against Q4 in the same scenario
    (the "moestream q4" rows when the suite ran them, else the Q4 row of that pool and tier)."""
    def key(r):
        return r["scenario"], r["tokens"], r["pool"], r["host_tier"]

    q4 = {key(r): r for r in runs if _model(r) == "qwen3-30b" and r["engine"] == "moestream"}
    q4 |= {key(r): r for r in runs if _model(r) == "qwen3-30b" and r["engine"] == "moestream q4"}
    lines = ["| scenario | host tier | engine | MB moved per token | of Q4 | tok/s | of Q4 |", "|" + "---|" * 7]
    for r in sorted((r for r in runs if r["engine"].startswith("moestream q") and r["engine"] != "moestream q4"),
                    key=lambda r: (r["scenario"], r["host_tier"], r["engine"])):
        base = q4.get(key(r))
        moved = (r["bytes"]["host"] + r["bytes"]["disk"]) / r["work"] / 1e6
        base_moved = (base["bytes"]["host"] + base["bytes"]["disk"]) / base["work"] / 1e6 if base else 0
        cells = [f"{r['scenario']} {r['tokens']}", "on" if r["host_tier"] else "off", r["engine"], f"{moved:,.1f}",
                 f"{moved / base_moved:.0%}" if base_moved else "-", _fmt(r["rate"]),
                 f"{r['rate'] / base['rate']:.2f}x" if base else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_report(path: str) -> None:
    state = json.load(open(os.path.join(path, "suite.json")))
    runs = state["runs"]
    lim = state.get("limits", {})
    record = f" ({lim['h2d_record_gbs']:.1f} in record-sized copies)" if "h2d_record_gbs" in lim else ""
    reads = (f" ({lim['disk_record_gbs']:.2f} / {lim['disk_record_gbs_16_threads']:.2f} in random record reads, "
             "8 / 16 threads)") if "disk_record_gbs" in lim else ""
    out = [f"Limits measured in the same run: pinned H2D {lim.get('h2d_pinned_gbs', 0):.1f} GB/s{record}, "
           f"O_DIRECT disk {lim.get('disk_odirect_gbs', 0):.2f} GB/s{reads}, "
           f"HBM copy {lim.get('hbm_copy_gbs', 0):.0f} GB/s, "
           f"dense bf16 matmul {lim.get('bf16_matmul_tflops', 0):.0f} TFLOP/s. Peers ran on the same geometry and "
           "prompts; their figures sit beside every moestream row of the same scenario.", ""]
    out += [f"Note: {note}\n" for note in state.get("notes", [])]
    for model in sorted({_model(r) for r in runs}):
        out += [f"## {model}", "", *table(runs, model), ""]
        if versus := against_llamacpp(runs, model):
            out += ["Against llama.cpp (issue 32; docs/performance.md says where moestream is behind, and why):", "",
                    *versus, ""]
        failed = [f"{r['engine']}: {r['error']}" for r in runs if _model(r) == model and r.get("error")]
        if failed:  # a peer this machine could not run, and why
            out += ["Peers that did not run: " + "; ".join(failed), ""]
        commits = {}
        for r in runs:
            if _model(r) == model and r.get("commit"):
                commits.setdefault(r["commit"][:7], set()).add(r["engine"])
        if len(commits) > 1:  # rows carried over from an earlier run of the suite
            out += ["Rows by commit: " + "; ".join(f"{c}: {', '.join(sorted(e))}" for c, e in commits.items()), ""]
    out += ["## Targets (issue 7, 30B geometry)", "", *targets(runs), ""]
    if any(r["engine"].startswith("moestream q") for r in runs):
        out += ["## Low-bit experts against Q4 (issue 8, 30B geometry, pool 25%)", "", *low_bit(runs), ""]
    with open(os.path.join(path, "report.md"), "w") as f:
        f.write("\n".join(out))
    print("\n".join(out))
    _plots(path, runs, state.get("hit_rates", {}))


def _plots(path: str, runs: list[dict], hit_rates: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = {(_model(r), r["scenario"], r["tokens"]) for r in runs if r["engine"] == "moestream"}
    for model, scenario, tokens in sorted(cases):
        fig, ax = plt.subplots(figsize=(6, 4))
        for host in (False, True):
            sel = sorted((r for r in runs if r["engine"] == "moestream" and _model(r) == model
                          and (r["scenario"], r["tokens"], r["host_tier"]) == (scenario, tokens, host)),
                         key=lambda r: r["pool"])
            if sel:
                label = "host tier" if host else "disk only"
                ax.plot([r["pool"] for r in sel], [r["rate"] for r in sel], "o-", label=f"moestream, {label}")
                bounds = [float("nan") if r.get("bound_invalid") else r.get("bound") or float("nan") for r in sel]
                ax.plot([r["pool"] for r in sel], bounds, "--", label=f"bound, {label}")
        ax.set_xlabel("GPU pool (fraction of the experts)")
        ax.set_ylabel("tok/s")
        ax.set_yscale("log")
        ax.set_title(f"{model}: {scenario} {tokens}")
        ax.legend()
        fig.savefig(os.path.join(path, f"{model}-{scenario}-{tokens}.png"), dpi=100, bbox_inches="tight")
        plt.close(fig)
    for model in sorted({key.split("/")[0] for key in hit_rates}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, rates in sorted(hit_rates.items()):
            if key.startswith(model + "/"):
                ax.plot(range(len(rates)), rates, label=key.split("/", 1)[1])
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("GPU pool hit rate")
        ax.set_title(f"{model}: hit rate per layer over the scenarios")
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(path, f"{model}-hit-rate.png"), dpi=100, bbox_inches="tight")
        plt.close(fig)
