"""A prompt's first forward: padded to one of a few sizes, and with every expert in the GPU pool, a CUDA graph.

A resident prefill layer waits on the host for nothing since its experts are grouped on the device (PlacedExperts),
yet at a few hundred tokens the host's launches take longer than the GPU's work. So a whole prompt of at most
`prefill_graph_tokens` (512 by default), of a model whose extra rows change nothing of a prompt's own
(`CausalLM.pads_prompts`), runs at the next of its sizes (`padded_sizes`: powers of two to 512, then multiples of
512): the extra rows repeat its last token, no expert computes them (experts/provider.py Padding),
and their cache rows land at positions the answer overwrites before it reads them. Every
tier pads alike, so a prompt's bits follow its padded size, never what is resident. With every record in the pool,
each size's forward is one CUDA graph, captured at load over a state of its own whose row map is loaded from the
sequence's before each replay.

While other sequences decode, such a replay runs `aside`: on a low-priority stream, the engine's steps on a
high-priority one (`stepping`), so the decoding batch keeps stepping instead of waiting for a prompt. With
`prefill_sms`, that replay is a second graph of the size captured on a green context's stream, whose kernels run on
that many SMs only, leaving the rest to the batch. Both run the kernels they run alone, so the bits are the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moestream.errors import ConfigError
from moestream.experts.provider import ExpertProvider, ExpertStep, Padding
from moestream.layers.context import StepContext
from moestream.models.base import CausalLM, SequenceState

SHORT_SIZES = (32, 64, 128, 256, 512)


def padded_sizes(longest: int = 512, chunk: int = 512) -> tuple[int, ...]:
    """The sizes whole prompts run at: SHORT_SIZES, then multiples of 512 up to `longest` that fit in a prefill
    `chunk` (a longer prompt is not whole) and the KV cache's positions (`chunk` is the smaller)."""
    return SHORT_SIZES + tuple(range(1024, min(longest, chunk) + 1, 512))


def padded_size(rows: int, sizes: tuple[int, ...] = SHORT_SIZES) -> int:
    """The rows of a whole prompt's forward of `rows` tokens (itself past the largest size)."""
    return next((size for size in sizes if size >= rows), rows)


@dataclass
class _Inputs:
    tokens: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]: 0..size-1
    entries: torch.Tensor  # [1]: the prompt's own routing entries


@dataclass
class _Graph:  # one per size, and one more on the green context's SMs when prompts run aside on them
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, H], written by each replay
    grown: int  # the KV pool's moves when it was captured (its stores are the graph's)


class Landing:
    """A prompt's forward replayed aside: its hidden rows once the GPU has run it."""

    def __init__(self, prefiller: Prefiller, graph: _Graph, rows: int, done: torch.cuda.Event):
        self.prefiller, self.graph, self.rows, self.done = prefiller, graph, rows, done

    def ready(self) -> bool:
        return self.done.query()

    def hidden(self) -> torch.Tensor:
        """The rows [rows, H] on the current stream (waiting for the replay there); the replay's uses are counted."""
        torch.cuda.current_stream(self.done.device).wait_event(self.done)
        self.prefiller.landed(self)
        return self.graph.hidden[: self.rows].clone()


def green_stream(device: torch.device, asked: int | str):
    """A green context of `asked` SMs and a stream in it; None for 0 (every SM). "auto" takes 36% of the GPU's (48
    of an H100's 132, which cut the serving p99 at 16-32 clients by a quarter for a few % of the aggregate), or every
    SM where green contexts are missing or refused; a number asked for is refused in one line."""
    if not asked:
        return None
    count = torch.cuda.get_device_properties(device).multi_processor_count
    sms = round(0.36 * count) if asked == "auto" else asked

    def refuse(why: str) -> None:
        if asked != "auto":
            raise ConfigError(f"--prefill-sms {sms}: {why}")

    try:
        from torch.cuda.green_contexts import SUPPORTED, GreenContext
    except ImportError:
        SUPPORTED = False
    if sms >= count:
        return refuse(f"this GPU has {count} SMs; choose fewer")
    if not (SUPPORTED and hasattr(GreenContext, "Stream")):
        return refuse("needs green contexts: torch 2.11+ built with CUDA 12.4+")
    try:
        green = GreenContext.create(num_sms=sms, device_id=device.index or 0)
        return green, green.Stream()
    except RuntimeError as e:  # the driver's refusal (MIG, an old driver)
        return refuse(f"no green context here ({str(e).splitlines()[0]})")


class Prefiller:
    def __init__(self, model: CausalLM, provider: ExpertProvider, decoder, device: torch.device,
                 dtype: torch.dtype, graphs: bool, prefill_sms: int | str = 0, sizes: tuple[int, ...] = SHORT_SIZES):
        """`decoder` (engine/decode.py): its KV pool, which the graphs' own state keeps its rows in; `prefill_sms`:
        the SMs a replay aside may take (0: every SM; "auto": `green_stream`); `sizes`: `padded_sizes`."""
        self.model, self.provider, self.decoder, self.device, self.dtype = model, provider, decoder, device, dtype
        self.sizes = sizes
        self.graphs_on = graphs and device.type == "cuda" and model.pads_prompts and decoder.kv is not None
        self.graphs: dict[int, _Graph] = {}
        self.partitioned: dict[int, _Graph] = {}  # the same forwards on the green context's SMs
        self.inputs: dict[int, _Inputs] = {}
        self.own: SequenceState | None = None
        self.pool = None  # the graphs' one memory pool: they replay one at a time, each output cloned at once
        self.layers = [block.layer_slot for block in model.moe_blocks()]
        self.replays = self.aside = 0  # replays, and those that ran beside decoding steps
        self.pending: Landing | None = None  # one at a time: the graphs share their memory
        self.green = None
        if self.graphs_on:
            low, high = torch.cuda.Stream.priority_range()
            self.side = torch.cuda.Stream(device, priority=low)
            self.front = torch.cuda.Stream(device, priority=high)
            if (green := green_stream(device, prefill_sms)) is not None:
                self.green, self.side = green

    def rows(self, prompt_tokens: int) -> int:
        """The positions a prompt's first forward writes (its KV blocks)."""
        return padded_size(prompt_tokens, self.sizes) if self.model.pads_prompts else prompt_tokens

    @torch.inference_mode()
    def __call__(self, ids: list[int], state: SequenceState, whole: bool = True,
                 aside: bool = False) -> torch.Tensor | Landing:
        """Feed `ids` after the state's tokens and advance the state; returns their final hidden rows [len(ids), H],
        or with `aside` and a graph to replay, its Landing. `whole`: they are a whole prompt (the first chunk of a
        longer one runs as it is)."""
        size = padded_size(len(ids), self.sizes)
        if not (whole and self.model.pads_prompts and state.length == 0 and size in self.sizes):
            return self.model(torch.tensor(ids, dtype=torch.long, device=self.device), state)
        state.make_room(size)  # blocks for every padded position, taken before the check (the KV pool may grow)
        replay = self._replayable(size, state)  # before the inputs: a capture loads them too
        inputs = self._load(size, ids)
        if not replay:
            hidden = self.model(inputs.tokens, state, self._context(inputs, len(ids)))[: len(ids)]
        else:
            self.provider.flush()  # the replay adds to the device's counts of placed uses: none left uncounted
            graph = self.partitioned[size] if aside and self.green is not None else self.graphs[size]
            with self._stream(aside) as stream:
                self.own.caches[0].row_map[:size].copy_(state.caches[0].row_map[:size])  # one table for every layer
                graph.graph.replay()
                self.pending = hidden = Landing(self, graph, len(ids), stream.record_event())
            self.replays += 1
            self.aside += aside
            if not aside:
                hidden = hidden.hidden()  # the next replay overwrites it
        state.advance(ids)
        return hidden

    def landed(self, landing: Landing) -> None:
        if landing is self.pending:
            self.pending = None
            self.provider.note_placed(self.layers)

    @contextlib.contextmanager
    def _stream(self, aside: bool):
        """The side stream (after the work queued so far) for a replay aside, else the current one."""
        current = torch.cuda.current_stream(self.device)
        if not aside:
            yield current
            return
        self.side.wait_stream(current)  # the state's blocks, the inputs just loaded
        with torch.cuda.stream(self.side):
            yield self.side

    @contextlib.contextmanager
    def stepping(self, prompts: bool):
        """Run an engine step on the high-priority stream, so that its kernels start ahead of a replay aside: only
        while one is in flight or the step has `prompts` to prefill, and prompts can replay (a suite run with every
        step on it had its 25% pool rows ~45% lower; a resident step pays two cross-stream waits)."""
        if not ((prompts or self.pending is not None) and self.graphs_on
                and self.provider.placed_prefill(self.sizes[-1])):
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self.front.wait_stream(current)
        try:
            with torch.cuda.stream(self.front):
                yield
        finally:
            current.wait_stream(self.front)

    def warm(self) -> None:
        """Capture each size's graph now, when every record is in the pool, so that no request pays for it."""
        if self.graphs_on:
            for size in self.sizes:
                if self.provider.placed_prefill(size):
                    self._capture(size)

    def _replayable(self, size: int, state: SequenceState) -> bool:
        """Whether this size's graph may run for `state` (captured again first when the KV pool's stores moved)."""
        if not (self.graphs_on and state.keeps_rows_in(self.decoder.kv) and self.provider.placed_prefill(size)):
            return False
        captured = self.graphs.get(size)
        if captured is None or captured.grown != self.decoder.kv.grown:
            self._capture(size)
        return True

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        """Run the size's forward once (kernels compiled, the address table built) and capture it, over the graphs'
        own state: its blocks are taken outside the capture and given back after; its map is loaded per replay."""
        own = self._own()
        inputs = self._load(size, [0])
        own.make_room(size)
        with self.provider.uncounted():
            self.model(inputs.tokens, own, self._context(inputs, 1))
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            self.graphs[size] = self._captured(inputs, own, None)
            if self.green is not None:  # a node runs in the context of the stream it was captured on
                self.partitioned[size] = self._captured(inputs, own, self.side)
        own.release()

    def _captured(self, inputs: _Inputs, own: SequenceState, stream: torch.cuda.Stream | None) -> _Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            hidden = self.model(inputs.tokens, own, self._context(inputs, 1))
        return _Graph(graph, hidden, self.decoder.kv.grown)

    def _own(self) -> SequenceState:
        if self.own is None:
            self.own = self.model.new_state(self.dtype, self.device)
            self.own.reserve(self.sizes[-1])
            self.own.share(self.decoder.kv)
        return self.own

    def _load(self, size: int, ids: list[int]) -> _Inputs:
        """The size's inputs holding `ids`, padded with its last token."""
        if size not in self.inputs:
            positions = torch.arange(size, device=self.device)
            self.inputs[size] = _Inputs(torch.zeros_like(positions), positions, torch.zeros_like(positions[:1]))
        inputs = self.inputs[size]
        inputs.tokens.copy_(torch.tensor(ids + ids[-1:] * (size - len(ids))))
        inputs.entries.fill_(len(ids) * self.model.config.num_experts_per_tok)
        return inputs

    def _context(self, inputs: _Inputs, rows: int) -> StepContext:
        return StepContext(inputs.positions, experts=ExpertStep(padding=Padding(rows, inputs.entries)))
