"""Adding a Q3 or Q2 expert file to a finished store, derived from its Q4 records (built on first use).

The new file is written beside the store under a temporary name, checked, renamed, and only then does
the manifest (rewritten atomically) mention it, so an interrupted build leaves the store as it was; the next
build resumes from the temporary file. A lock file in the store lets one process derive at a time; the others wait
and then find the file ready (or resume it, if the one deriving died)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moestream.errors import StoreError
from moestream.experts.format import MANIFEST, RecordLayout, experts_file, write_manifest
from moestream.experts.store import Store, open_store
from moestream.packer.checks import file_check
from moestream.packer.records import derive_record

BATCH = 64
LOCK_FILE = ".derive.lock"


def _resume_point(partial: str, stride: int) -> int:
    """Records a cut-short derivation finished, less one batch in case its last writes did not reach the disk."""
    if not os.path.exists(partial):
        return 0
    return max(0, os.path.getsize(partial) // stride - BATCH) // BATCH * BATCH


@contextmanager
def _store_lock(store_path: str, show_progress: bool):
    """One derivation per store at a time, across processes; the kernel drops the lock if its holder dies."""
    path = os.path.join(store_path, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StoreError(f"{path}: cannot create the lock for deriving experts ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if show_progress:
                print(f"waiting for another process deriving experts in {store_path}...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def ensure_precision(store_path: str, precision: str, show_progress: bool = True) -> None:
    m = open_store(store_path, verify=False).manifest
    if precision in m.layouts:
        return
    if precision not in ("q3", "q2"):
        raise StoreError(f"{store_path} has no {precision} experts, and only q3/q2 can be derived; pack again")
    if "q4" not in m.layouts:
        raise StoreError(f"{store_path} has no q4 experts to derive {precision} from; pack with --experts 4,3,2")
    with _store_lock(store_path, show_progress):
        store = open_store(store_path, verify=False)  # another process may have derived it while we waited
        if precision not in store.manifest.layouts:
            _derive(store, precision, show_progress)


def _derive(store: Store, precision: str, show_progress: bool) -> None:
    store_path, m = store.path, store.manifest
    q4 = m.layouts["q4"]
    low = RecordLayout.build(precision, q4.hidden_size, q4.intermediate_size, q4.group_size)
    total = m.geometry.num_records
    final = os.path.join(store_path, experts_file(precision))
    # named for the Q4 file it derives from, so a resumed build never mixes in another store's records
    partial = f"{final}.{m.files[experts_file('q4')].sha256[:16]}.partial"
    done = min(_resume_point(partial, low.stride), total // BATCH * BATCH)  # a too-long file is cut back
    if show_progress:
        resumed = f", resuming at {done}" if done else ""
        print(f"deriving {precision} experts from q4 ({total} records, once{resumed})...", file=sys.stderr)
    # a GPU derives a batch in milliseconds; the CPU path is byte-wise too, so either keeps up with the disk
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ui = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), disable=not (show_progress and sys.stderr.isatty()), transient=True)
    with ui, open(store.experts_path("q4"), "rb") as src, open(partial, "r+b" if done else "wb") as dst:
        task = ui.add_task(f"deriving {precision}", total=total)
        src.seek(done * q4.stride)
        dst.truncate(done * low.stride)
        dst.seek(done * low.stride)
        for start in range(done, total, BATCH):
            ui.update(task, completed=start)
            n = min(BATCH, total - start)
            raw = bytearray(src.read(n * q4.stride))
            if len(raw) != n * q4.stride:
                raise StoreError(f"{store.experts_path('q4')} is shorter than its manifest says")
            records = torch.frombuffer(raw, dtype=torch.uint8).view(n, q4.stride).to(device)
            dst.write(derive_record(records, q4, low).cpu().numpy().tobytes())
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(partial, final)
    with open(os.path.join(store_path, MANIFEST)) as f:
        raw = json.load(f)
    raw["experts"]["precisions"][precision] = low.to_json()
    check = file_check(final)
    raw["files"][experts_file(precision)] = {"size": check.size, "sha256": check.sha256,
                                             "sample_sha256": check.sample_sha256}
    write_manifest(store_path, raw)  # sealed with its new checksum
