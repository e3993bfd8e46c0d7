"""Which source lines a decode step's GPU kernels come from: the static step run eagerly (`decode_mode="eager"`,
the same ops the graph captures) under the profiler, each aten op labelled with the moestream line that called
it. A generate of 1 + N tokens less one of 1 token, so the prompt's prefill cancels. Written for Flash-Next's
resident step, which sits far below its HBM bound (docs/performance.md).

python -m benchmarks.probes.step_ops STORE [--steps 8] [--max-context 8192] [--top 60]
"""

from __future__ import annotations

import argparse
import traceback
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def caller() -> str:
    """The innermost moestream line outside the kernel dispatcher."""
    frames = [f for f in traceback.extract_stack()
              if "/moestream/" in f.filename and not f.filename.endswith("kernels/ops.py")]
    return f"{frames[-1].filename.split('moestream/')[-1]}:{frames[-1].lineno}" if frames else "?"


class Labelled(TorchDispatchMode):
    def __torch_dispatch__(self, fn, types, args=(), kwargs=None):
        with record_function("@" + caller()):
            return fn(*args, **(kwargs or {}))


def line_of(event) -> str:
    while event is not None and not event.name.startswith("@"):
        event = event.cpu_parent
    return event.name[1:] if event is not None else "?"


def kernel_time(llm: LLM, ids: list[int], tokens: int) -> dict[tuple, list[float]]:
    """(kernel, aten op, line, input shapes) -> [launches, us] for one generate of `tokens` tokens."""
    out: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        with Labelled():
            llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for e in prof.events():
        for k in e.kernels:
            key = (k.name[:60], e.name, line_of(e), str(list(zip(e.input_shapes, e.input_dtypes)))[:100])
            out[key][0] += 1
            out[key][1] += k.duration
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--top", type=int, default=60)
    args = p.parse_args()
    llm = LLM(args.store, decode_mode="eager", max_context=args.max_context)
    ids = list(range(1000, 1016))
    llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))  # compiled
    base, total = kernel_time(llm, ids, 1), kernel_time(llm, ids, 1 + args.steps)
    rows = {k: [(n - base.get(k, [0, 0])[0]) / args.steps, (us - base.get(k, [0, 0])[1]) / args.steps]
            for k, (n, us) in total.items()}
    print(f"{sum(r[1] for r in rows.values()):.1f} us and {sum(r[0] for r in rows.values()):.0f} launches a step "
          "in aten ops (Triton kernels launch outside them and are not listed)")
    for (kernel, op, line, shapes), (n, us) in sorted(rows.items(), key=lambda r: -r[1][1])[:args.top]:
        print(f"{us:8.1f} us {n:5.1f}x  {line:28s} {op:28s} {kernel:60s} {shapes}")


if __name__ == "__main__":
    main()
