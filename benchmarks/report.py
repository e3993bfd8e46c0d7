"""The suite's report: a markdown table (moestream beside each peer and the bound, per scenario) and PNG
plots (tok/s against pool size with the bound drawn in)."""

from __future__ import annotations

import json
import os


def write_report(path: str) -> None:
    state = json.load(open(os.path.join(path, "suite.json")))
    runs = state["runs"]
    lines = ["| model | scenario | pool | host tier | engine | tok/s | bound | of bound |", "|" + "---|" * 8]
    for r in sorted(runs, key=lambda r: (r.get("model", ""), r["scenario"], r["tokens"], -r["pool"], r["engine"])):
        bound = r.get("bound")
        lines.append(f"| {r.get('model', 'qwen3-30b')} | {r['scenario']} {r['tokens']} | {r['pool']:.0%} | "
                     f"{'on' if r['host_tier'] else 'off'} | {r['engine']} | {r['rate']:.1f} | "
                     f"{bound:.1f} | {r['rate'] / bound:.0%} |" if bound else
                     f"| {r.get('model', 'qwen3-30b')} | {r['scenario']} {r['tokens']} | {r['pool']:.0%} | "
                     f"{'on' if r['host_tier'] else 'off'} | {r['engine']} | {r['rate']:.1f} | - | - |")
    lim = state.get("limits", {})
    record = f" ({lim['h2d_record_gbs']:.1f} in record-sized copies)" if "h2d_record_gbs" in lim else ""
    header = (f"Limits measured in the same run: pinned H2D {lim.get('h2d_pinned_gbs', 0):.1f} GB/s{record}, "
              f"O_DIRECT disk {lim.get('disk_odirect_gbs', 0):.2f} GB/s, "
              f"HBM copy {lim.get('hbm_copy_gbs', 0):.0f} GB/s.\n\n")
    with open(os.path.join(path, "report.md"), "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for scenario, tokens in {(r["scenario"], r["tokens"]) for r in runs if r["engine"] == "moestream"}:
        fig, ax = plt.subplots(figsize=(6, 4))
        for host in (False, True):
            sel = sorted((r for r in runs if r["engine"] == "moestream" and r["scenario"] == scenario
                          and r["tokens"] == tokens and r["host_tier"] == host), key=lambda r: r["pool"])
            if sel:
                label = "host tier" if host else "disk only"
                ax.plot([r["pool"] for r in sel], [r["rate"] for r in sel], "o-", label=f"moestream, {label}")
                ax.plot([r["pool"] for r in sel], [r["bound"] or 0 for r in sel], "--", label=f"bound, {label}")
        ax.set_xlabel("GPU pool (fraction of the experts)")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{scenario} {tokens}")
        ax.legend()
        fig.savefig(os.path.join(path, f"{scenario}-{tokens}.png"), dpi=100, bbox_inches="tight")
        plt.close(fig)
