"""Q4 experts on the host CPU, from records in host memory (the host tier): host_experts.c, built at first use
with the system's C compiler (`cc -O3 -march=native -fopenmp`) into the user's cache and called through ctypes,
which releases the GIL, so the caller's thread keeps feeding the GPU meanwhile. Its torch reference is
`reference.expert_group`. Weights are dequantized to bf16 and activations taken in bf16, as the GPU's prefill
kernel does, but its fp32 sums run in another order, so a row computed here differs from the GPU's in its last
bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from moestream.experts.format import RecordLayout
from moestream.experts.grouping import HostExperts

SOURCE = os.path.join(os.path.dirname(__file__), "host_experts.c")
FIELDS = ("gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b", "down_w", "down_s", "down_b")


def _cpu_identity() -> str:
    """What -march=native compiles for: the model and flags of this host's CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        return platform.processor()


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The built kernel, or why there is none (one line)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc) on this machine"
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + cc.encode() + _cpu_identity().encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream")
    path = os.path.join(cache, f"host_experts-{key}.so")
    if not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", SOURCE, "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            return f"building the host expert kernel failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
        os.replace(tmp, path)  # atomic: another process may be building the same file
    lib = ctypes.CDLL(path)
    lib.q4_experts.restype = None
    lib.q4_experts.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 4
    return lib


def unavailable(layout: RecordLayout) -> str | None:
    """Why records of `layout` cannot be computed here (None: they can)."""
    if layout.bits != 4 or layout.group_size != 64:
        return f"the host expert kernel computes Q4 records of group 64, not {layout.precision}"
    lib = _library()
    return lib if isinstance(lib, str) else None


def expert_group(x: torch.Tensor, records: list[int], layout: RecordLayout, spans: list[tuple[int, int]],
                 order: torch.Tensor, top_k: int, threads: int | None = None) -> torch.Tensor:
    """Experts j (Q4 record at host address records[j]) over their routing entries order[spans[j][0]:spans[j][1]]
    (flat row * top_k + k) of x [T, H] on the host -> their unweighted outputs [entries, H] in x's dtype, in the
    entries' order (expert by expert). `threads`: OpenMP threads (default: torch's)."""
    lib = _library()
    assert not isinstance(lib, str), lib
    hidden, inter = layout.hidden_size, layout.intermediate_size
    entries = torch.cat([order[a:b] for a, b in spans]) if spans else order[:0]
    m = entries.shape[0]
    rows = x[entries // top_k].to(torch.bfloat16).view(m, hidden // 64, 8, 4, 2)
    rows = rows.permute(0, 1, 3, 4, 2).contiguous()  # lane order (host_experts.c)
    bounds = [0]
    for a, b in spans:
        bounds.append(bounds[-1] + b - a)
    spans_t = torch.tensor(bounds, dtype=torch.int64)
    records_t = torch.tensor(records, dtype=torch.uint64)
    offsets = torch.tensor([layout.field(f).offset for f in FIELDS], dtype=torch.int64)
    gate, up, h = torch.empty(m, inter), torch.empty(m, inter), torch.empty(m, inter, dtype=torch.bfloat16)
    y = torch.empty(m, hidden)
    lib.q4_experts(rows.data_ptr(), spans_t.data_ptr(), records_t.data_ptr(), len(records), hidden, inter,
                   offsets.data_ptr(), threads or torch.get_num_threads(), *(t.data_ptr() for t in (gate, up, h, y)))
    return y.to(x.dtype)


def random_records(layout: RecordLayout, n: int) -> list[torch.Tensor]:
    """`n` records of random codes with scales and biases of a real model's size (timing: no NaN, no denormals)."""
    records = []
    for _ in range(n):
        record = torch.randint(0, 256, (layout.stride,), dtype=torch.uint8)
        v = layout.views(record)
        for p in ("gate", "up", "down"):
            v[f"{p}_s"].copy_(torch.rand(v[f"{p}_s"].shape) * 1e-3 + 1e-3)
            v[f"{p}_b"].copy_(-8 * v[f"{p}_s"].float())
        records.append(record)
    return records


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="moestream-cpu-experts")


def submit(part: HostExperts) -> None:
    """Start the CPU on `part` (in a worker thread: the caller goes on enqueueing GPU work); sets part.future, whose
    result is the outputs [M, H] in pinned memory where the rows were pinned."""
    def job() -> torch.Tensor:
        for wait in part.waits:
            if wait is not None:
                wait.result()
        part.landed.synchronize()
        begin = time.perf_counter()
        rows = part.rows
        y = expert_group(rows, part.records, part.layout, part.spans, torch.arange(rows.shape[0]), 1, part.threads)
        part.seconds = time.perf_counter() - begin
        return y.pin_memory() if rows.is_pinned() else y

    part.future = _worker().submit(job)


def measure(layout: RecordLayout, threads: int, records: int = 4) -> tuple[float, float]:
    """The CPU's time per expert of `layout` as (fixed seconds, seconds per row), from 1- and 16-row runs over
    `records` random records at once, each the best of three."""
    recs = random_records(layout, records)
    ptrs = [r.data_ptr() for r in recs]

    def per_expert(rows: int) -> float:
        x = torch.randn(rows * records, layout.hidden_size, dtype=torch.bfloat16)
        spans = [(j * rows, (j + 1) * rows) for j in range(records)]
        times = []
        for _ in range(4):
            start = time.perf_counter()
            expert_group(x, ptrs, layout, spans, torch.arange(x.shape[0]), 1, threads)
            times.append(time.perf_counter() - start)
        return min(times[1:]) / records

    one, many = per_expert(1), per_expert(16)
    per_row = max(0.0, (many - one) / 15)
    return max(0.0, one - per_row), per_row
