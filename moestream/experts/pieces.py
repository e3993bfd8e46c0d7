"""A decode step in pieces: when some record is neither in the GPU pool nor readable in place (records on disk), the
step is still captured, as one CUDA graph per stretch from one MoE layer's experts to the next one's routing
(engine/decode.py). Between two pieces the host reads the layer's routing, brings its records into pool slots (hits,
or misses fetched as the decode path fetches them) and writes their addresses here, where the next piece's expert
kernels read them. The kernels are those of a whole-step graph, so the bits are the same."""

from __future__ import annotations

import torch

from moestream.experts.decode import DecodePath
from moestream.experts.grouping import AddressedExperts


class PieceTable:
    def __init__(self, decode: DecodePath):
        """`decode`: the decode path, whose lookahead a piece's host turn makes too."""
        self.decode, self.res = decode, decode.res
        res = self.res
        shape, device = (res.geometry.num_layers, res.geometry.num_experts), res.device.device
        pinned = res.device.cuda
        with torch.inference_mode(False):  # outlives the step that makes it; later steps write it
            self.addresses = torch.zeros(shape, dtype=torch.int64, device=device)
            self.staged = torch.zeros(shape, dtype=torch.int64, pin_memory=pinned)  # the host's rows, copied over
            self.bits = self.staged_bits = None
            if res.miss != res.base:  # mixed mode: each record's precision, as AddressTable.record_bits
                self.bits = torch.zeros(shape, dtype=torch.int32, device=device)
                self.staged_bits = torch.zeros(shape, dtype=torch.int32, pin_memory=pinned)
        self.staged_view = self.staged.numpy()  # the staged rows as numpy: a fancy assignment costs ~1 us, torch's ~10
        self.staged_bits_view = self.staged_bits.numpy() if self.bits is not None else None
        self.used: list[int] = []  # the last resolved layer's slots, until the piece that reads them is enqueued
        self.guesses: tuple[int, list[int]] | None = None  # a prefetch left until the next piece is enqueued

    def part(self, layer: int, ids: torch.Tensor) -> AddressedExperts:
        """Layer `layer`'s routing entries `ids` [T, top_k], each reading its record where `resolve` put it."""
        res = self.res
        low_bit = (res.layouts[res.miss], self.bits[layer]) if self.bits is not None else None
        return AddressedExperts(self.addresses[layer], ids.reshape(-1), res.layouts[res.base], low_bit, None)

    def resolve(self, layer: int, routed: torch.Tensor, x: torch.Tensor) -> None:
        """The host's turn after layer `layer`'s routing (`routed` [rows * top_k] expert ids on the device, read
        here: the pieces so far have run; x [rows, H] the layer's input): its records into pool slots, counted as a
        decode step's lookups; the compute stream waits for the copies of this layer's. The GPU idles meanwhile,
        so the next layer's predicted records are fetched early here only if this layer's misses are waited for
        anyway, else once the next piece is enqueued (`settle`)."""
        res, pool = self.res, self.res.pool
        self.settle()
        res.flush()
        predicted = self.decode.predict(layer, x)  # the lookahead's guess, read back with the routing: one wait
        ids = (routed if predicted is None else torch.cat([routed, predicted])).tolist()
        ids, guesses, rows = ids[:routed.numel()], sorted(set(ids[routed.numel():])), x.shape[0]
        if res.trace is not None:
            top_k = len(ids) // rows
            res.trace.step(layer, [ids[r * top_k:(r + 1) * top_k] for r in range(rows)], rows)
        experts = sorted(set(ids))
        pool.new_step()
        slots, futures, missed = self.decode.claim(layer, experts)
        if missed:
            self.decode.prefetch(layer, guesses)
        else:
            self.guesses = layer, guesses
        res.wait(layer, slots, futures)
        base = pool.buffer.data_ptr()
        self.staged_view[layer, experts] = [base + s * pool.stride for s in slots]
        self.addresses[layer].copy_(self.staged[layer], non_blocking=True)
        if self.bits is not None:
            self.staged_bits_view[layer, experts] = [res.layouts[pool.precision_of[s]].bits for s in slots]
            self.bits[layer].copy_(self.staged_bits[layer], non_blocking=True)
        self.used = slots

    def settle(self) -> None:
        """The piece that reads the last resolved slots is enqueued: a later copy into them waits for it, and the
        prefetch left for this moment starts."""
        if self.used:
            self.res.done(self.used)
            self.used = []
        if self.guesses is not None:
            self.decode.prefetch(*self.guesses)
            self.guesses = None
