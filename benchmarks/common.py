"""Shared benchmark plumbing: the physical limits measured in the same run, and result files.

Every benchmark prints its figure beside the limit it is bounded by, and writes JSON + markdown into
`results/<name>/` (or `$OUT/<name>/` on the GPU machine); git tracks only `results/suite/`, the latest suite."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time

import torch

# the stores and state a GPU machine keeps between calls (device.sh's $WORK)
BENCH_DIR = os.environ.get("MOESTREAM_BENCH_DIR", "/tmp/moestream-bench")


def out_dir(name: str) -> str:
    """`$OUT/<name>` on the GPU machine, else the checkout's `results/<name>` (a rerun replaces the last)."""
    root = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
    path = os.path.normpath(os.path.join(root, name))
    os.makedirs(path, exist_ok=True)
    return path


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    # the device machine's copy of the tree may carry a stale .git: the caller names the commit it sent
    info["commit"] = os.environ.get("MOESTREAM_COMMIT")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=os.path.dirname(__file__)).stdout.strip()
        except OSError:
            pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, hbm_gb=round(p.total_memory / 1e9, 1))
        import triton

        info["triton"] = triton.__version__
    return info


def write(path: str, name: str, data: dict, table: list[list] | None = None, header: list[str] | None = None) -> None:
    with open(os.path.join(path, f"{name}.json"), "w") as f:
        json.dump({"machine": machine(), **data}, f, indent=1, default=str)
    if table:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
        with open(os.path.join(path, f"{name}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


def cuda_time(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def hbm_copy_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / cuda_time(lambda: b.copy_(a), iters=20) / 1e9


def h2d_gbs(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / cuda_time(lambda: b.copy_(a, non_blocking=True), iters=10) / 1e9


def h2d_record_gbs(pool_bytes: int = 16 << 30, record: int = 2_654_208, copies: int = 256) -> float:
    """Pinned H2D as the host tier does it: record-sized copies from scattered slots of one large pinned
    buffer (prefill from the host tier copied at ~19 GB/s against 55 for one 1 GB copy)."""
    import random

    from moestream.experts.memory import host_buffer

    src = host_buffer(pool_bytes, pinned=True)
    dst = torch.empty(64, record, dtype=torch.uint8, device="cuda")
    slots = random.Random(0).sample(range(pool_bytes // record), copies)

    def run():
        for i, slot in enumerate(slots):
            dst[i % 64].copy_(src[slot * record: (slot + 1) * record], non_blocking=True)

    return copies * record / cuda_time(run, iters=5, warmup=1) / 1e9


def bf16_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / cuda_time(lambda: a @ b, iters=20) / 1e12


def _odirect_gbs(path: str, offsets: list[int], size: int, threads: int) -> float:
    """Read `size` bytes at each offset of `path` with O_DIRECT from `threads` threads; GB/s."""
    from concurrent.futures import ThreadPoolExecutor

    from moestream.experts.memory import host_buffer

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    bufs = [host_buffer(size, torch.cuda.is_available()) for _ in range(threads)]

    def read(i):
        return os.preadv(fd, [memoryview(bufs[i % threads].numpy())], offsets[i])

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, range(len(offsets))))
    seconds = time.perf_counter() - start
    os.close(fd)
    return total / seconds / 1e9


def disk_gbs(path: str | None = None, nbytes: int = 2 << 30, block: int = 4 << 20, threads: int = 8) -> float:
    """O_DIRECT read bandwidth of a fresh file (written here, so the page cache cannot serve it)."""
    fd_path = path or os.path.join(tempfile.gettempdir(), "moestream-disk-probe.bin")
    with open(fd_path, "wb") as f:
        chunk = os.urandom(block)
        for _ in range(nbytes // block):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    gbs = _odirect_gbs(fd_path, [i * block for i in range(nbytes // block)], block, threads)
    os.remove(fd_path)
    return gbs


def disk_record_gbs(path: str, stride: int, reads: int = 256, threads: int = 8) -> float:
    """O_DIRECT reads of whole records at random places in a store's experts file, as the engine reads them."""
    import random

    records = os.path.getsize(path) // stride
    picks = random.Random(0).sample(range(records), min(reads, records))
    return _odirect_gbs(path, [r * stride for r in picks], stride, threads)


def limits(disk_path: str | None = None, records: tuple[str, int] | None = None) -> dict:
    """The physical limits; `records` = (experts file, stride) adds record-sized random disk reads."""
    out = {"hbm_copy_gbs": hbm_copy_gbs(), "h2d_pinned_gbs": h2d_gbs(), "h2d_record_gbs": h2d_record_gbs(),
           "bf16_matmul_tflops": bf16_matmul_tflops()}
    out["disk_odirect_gbs"] = disk_gbs(disk_path)
    if records is not None:
        out["disk_record_gbs"] = disk_record_gbs(*records)
        out["disk_record_gbs_16_threads"] = disk_record_gbs(*records, threads=16)
    return out


def tier_gb(store: str, pool_frac: float | None, host: bool) -> tuple[float | None, float]:
    """GPU pool and host-tier sizes for a pool of `pool_frac` of the store's expert records (None: the engine's own
    choice), the rest in the host tier with `host` (0 without)."""
    from moestream.experts.store import open_store

    opened = open_store(store)
    total_gb = opened.manifest.geometry.num_records * opened.manifest.layouts[opened.default_precision].stride / 1e9
    return (total_gb * pool_frac * 1.0001 if pool_frac is not None else None), (total_gb * 1.01 if host else 0.0)
