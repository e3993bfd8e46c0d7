"""Per-row copies of a recurrent state, for a verify step's rollback. A static step of k+1 rows runs each recurrence
row by row, as k+1 decode steps would, and keeps the state after every row; when only the first n rows are
accepted, the state after row n - 1 is put back. The copies are fixed buffers, so a captured verify graph writes
them in place."""

from __future__ import annotations

import torch


class RowCopies:
    def __init__(self, tensors: list[torch.Tensor], rows: int):
        self.tensors = tensors
        self.copies = [t.new_empty(rows, *t.shape) for t in tensors]

    @property
    def rows(self) -> int:
        return self.copies[0].shape[0]

    def keep(self, row: int) -> None:
        for t, c in zip(self.tensors, self.copies):
            c[row].copy_(t)

    def rewind(self, row: int) -> None:
        for t, c in zip(self.tensors, self.copies):
            t.copy_(c[row])

    def bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)


def reserve_rows(copies: RowCopies | None, tensors: list[torch.Tensor], rows: int) -> RowCopies:
    """`copies` when they already hold `rows` rows of these tensors, else new ones."""
    if copies is not None and copies.rows >= rows and all(a is b for a, b in zip(copies.tensors, tensors)):
        return copies
    return RowCopies(tensors, rows)


class Batched(list):
    """One layer's states for the rows of a batched step, row r's being its own sequence's; an attribute is every
    row's, batched (a PLE layer's `mixer` and `ple`). Its rows are whole steps of their sequences: none is kept for
    a rollback."""

    def __getattr__(self, name: str) -> Batched:
        if name.startswith("__"):
            raise AttributeError(name)
        return Batched(getattr(s, name) for s in self)

    def keep(self, row: int) -> None:
        pass


def row_state(state, row: int):
    """Row `row`'s state of a static step: its own sequence's in a batched step, else the one sequence's."""
    return state[row] if isinstance(state, Batched) else state
