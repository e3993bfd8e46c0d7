"""What one 30B expert costs on this host's CPU (issue 34's CPU expert path), against its PCIe copy.

For rows 1..256 of one Q4 record: the reference (dequantize to bf16, three matmuls), torch's CPU int4 GEMM
(`_weight_int4pack_mm_for_cpu`, after repacking the record's codes into its blocked layout, timed apart), and a
bf16 matmul of weights already dequantized (what a fused dequantizing kernel could reach at best).

python -m benchmarks.probes.cpu_experts [--rows 1,8,32,128,256] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
import torch.nn.functional as F

from moestream.experts.format import RecordLayout
from moestream.kernels.reference import expert_weights
from moestream.quant.affine import unpack_codes


def _time(fn, reps: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _record(layout: RecordLayout) -> torch.Tensor:
    record = torch.randint(0, 256, (layout.stride,), dtype=torch.uint8)
    v = layout.views(record)
    for p in ("gate", "up", "down"):  # finite scales and biases of the synthetic store's size
        v[f"{p}_s"].copy_(torch.rand(v[f"{p}_s"].shape) * 1e-3 + 1e-3)
        v[f"{p}_b"].copy_(-8 * v[f"{p}_s"].float())
    return record


def _int4pack(record: torch.Tensor, layout: RecordLayout):
    """(packed weight, scales_and_zeros) per projection for torch's CPU int4 GEMM: w = (q - 8) * s + z, so z =
    bias + 8 s (rounded to bf16: not the records' bits)."""
    v, out = layout.views(record), []
    for p in ("gate", "up", "down"):
        codes = unpack_codes(v[f"{p}_w"], 4)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        s, b = v[f"{p}_s"].float(), v[f"{p}_b"].float()
        out.append((packed, torch.stack([s, b + 8 * s], -1).transpose(0, 1).contiguous().to(torch.bfloat16)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8,32,128,256")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("\n".join(line for line in cpu.splitlines() if line.split(":")[0] in (
        "Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "L3 cache", "NUMA node(s)")))
    flags = next((line for line in cpu.splitlines() if line.startswith("Flags")), "")
    print("flags:", " ".join(f for f in flags.split() if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))))
    print("torch threads", torch.get_num_threads(), "capability", torch.backends.cpu.get_cpu_capability())
    layout = RecordLayout.build("q4", 2048, 768)
    record = _record(layout)
    weights = expert_weights(record, layout, torch.bfloat16)
    repack = _time(lambda: _int4pack(record, layout), 3)
    packed = _int4pack(record, layout)
    dequant = _time(lambda: expert_weights(record, layout, torch.bfloat16), 3)
    copy_us = layout.stride / 51.9e9 * 1e6
    print(json.dumps({"record_mb": layout.stride / 1e6, "pcie_copy_us": round(copy_us, 1),
                      "dequant_bf16_us": round(dequant * 1e6), "int4_repack_us": round(repack * 1e6)}))
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, 2048, dtype=torch.bfloat16)

        def bf16(x=x, w=weights):
            gate, up, down = w
            return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

        def int4(x=x):
            (gw, gs), (uw, us), (dw, ds) = packed
            h = F.silu(torch.ops.aten._weight_int4pack_mm_for_cpu(x, gw, 64, gs)) * \
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, uw, 64, us)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(h, dw, 64, ds)

        err = (int4().float() - bf16().float()).norm() / bf16().float().norm()
        row = {"rows": rows, "bf16_mm_us": round(_time(bf16) * 1e6), "int4_mm_us": round(_time(int4) * 1e6),
               "int4_vs_bf16_err": float(err)}
        row["gflops_int4"] = round(rows * 3 * 2 * 2048 * 768 / (row["int4_mm_us"] * 1e3), 1)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
