"""What a process's first long prompt pays once (suite v5: ~0.7 s on the 30B geometry, ~1.4 s on flash-next,
at the first prompt of 512 tokens after a 64-token warm-up). Suspect: the cuDNN SDPA backend building its graph.
Each backend runs in a fresh process, so every first call is a first call. On the H200 (session 15): cuDNN (and
the default choice) paid 41-97 ms at every new length and 1.16 s at the first 256-wide-head call; flash attention
0.1-5.5 ms. The engine's prefill attention runs flash attention since.

python -m benchmarks.first_prompt    # on the GPU machine
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch
import torch.nn.functional as F

LENGTHS = (64, 512, 4096, 512, 2048)


def _time_calls(backend: str, heads: int, kv_heads: int, head_dim: int) -> list[float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = [] if backend == "default" else [getattr(SDPBackend, backend)]
    out = []
    for t in LENGTHS:
        q = torch.randn(1, heads, t, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, t, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if chosen:
            with sdpa_kernel(chosen):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    if len(sys.argv) > 1:  # the child: one backend, one shape
        backend, *shape = sys.argv[1:]
        try:
            seconds = _time_calls(backend, *map(int, shape))
        except RuntimeError as e:  # e.g. memory-efficient attention has no GQA kernel
            print(f"{backend:>20} heads {shape}: {str(e).splitlines()[0]}")
            return
        print(f"{backend:>20} heads {shape}: " + ", ".join(f"T={t} {s * 1e3:.1f} ms" for t, s in zip(LENGTHS, seconds)))
        return
    for shape in ((32, 4, 128), (16, 2, 256)):  # the 30B and flash-next attention shapes
        for backend in ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            subprocess.run([sys.executable, "-m", "benchmarks.first_prompt", backend, *map(str, shape)], check=False)


if __name__ == "__main__":
    main()
