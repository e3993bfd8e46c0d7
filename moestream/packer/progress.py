"""Progress for long packs: a rich bar on stderr over the bytes still to write and check."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


class PackProgress:
    def __init__(self, src, geometry, layouts, dense, enabled: bool = True):
        stride = sum(layout.stride for layout in layouts.values())
        self.layer_bytes = geometry.num_experts * stride
        self.total = geometry.num_layers * self.layer_bytes
        self.total += sum(src.tensors[n].nbytes for n in dense)
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled,
        )
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("packing experts", total=self.total)
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)

    def skip_layer(self) -> None:
        """A layer a resumed pack had already written."""
        self.advance(self.layer_bytes)

    def phase(self, name: str) -> None:
        self.progress.update(self.task, description=name)

    def start_checksums(self, total_bytes: int) -> None:
        """Hashing re-reads every file: a bar of its own."""
        self.progress.update(self.task, description="packed")
        self.task = self.progress.add_task("checksums", total=total_bytes)

    def advance_check(self, nbytes: int) -> None:
        self.advance(nbytes)
