"""Decode steps: one token (or a verify step's few) through the model's own forward.

On CUDA a step has static shapes: attention over a paged cache whose row map covers `max_context` positions, masked
by a device-side position, recurrent states updated in place, experts one tile per routing entry, host work it needs
(a PLE table's rows on disk) staged before it. When every expert record is addressable without a host decision (all
in the GPU pool, or the rest read in place from the pinned host tier) the step is a CUDA graph of that forward,
captured once (at load) over the decoder's own sequence state, which every new sequence reuses; otherwise (records
on disk) the step is captured in pieces, one graph from each MoE layer's experts to the next one's routing, with the
host's decision between them (experts/pieces.py); in `eager` and `handshake` modes it runs eagerly, routing each
layer through the host. All give the same bits, so the output does not depend on what was resident. A verify step
(speculative decoding) is the same static step over k+1 rows, one graph per row count, whose rows have the bits of
single steps; the caller keeps a prefix of them (`SequenceState.accept`). A batched step is the same static step
over one row of each of several sequences (`step_batch`), each row on its own sequence's state; the decoder keeps
one state per batch slot, and a batch of the first n slots replays its own graph. On the CPU a step is the plain
eager forward, or the static one where verify or batched steps are wanted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.config import EngineConfig
from moestream.experts.provider import ExpertProvider, ExpertStep
from moestream.layers.context import StepContext
from moestream.layers.kv import BlockPool, KVRows, blocks_for
from moestream.layers.rows import Batched
from moestream.models.base import CausalLM, SequenceState


@dataclass
class StepInputs:
    """A static step's device inputs for `rows` token rows: what a captured graph reads and writes."""

    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]: the decoder's start position plus 0..rows-1
    offsets: torch.Tensor  # [rows]
    routed: torch.Tensor  # [record layers, rows * top_k] the routers' expert ids (-1: a layer the step skips)
    hidden: torch.Tensor | None = None  # [rows, H] the trunk's, for the MTP head's steps


class Ahead:
    """A greedy step launched before the host read the previous one's tokens (`Decoder.step_ahead`,
    `step_batch_ahead`): its rows' tokens on their way to the host, and a lone row's final hidden state where it was
    kept [1, H]."""

    def __init__(self, token: torch.Tensor, done: torch.cuda.Event | None, hidden: torch.Tensor | None):
        self.token, self.done, self.hidden = token, done, hidden

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.token.tolist()


class Decoder:
    def __init__(self, model: CausalLM, provider: ExpertProvider, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, static: bool | None = None, max_rows: int = 1, max_batch: int = 1,
                 kv_tokens: int | None = None):
        """`static`: whether steps have static shapes (default: on CUDA, when the model is graph-safe, or where
        verify or batched steps are wanted; the CPU tests ask for them to run the GPU's step with the reference
        kernels). `max_rows`: the most rows a verify step has (1 + drafts); `max_batch`: a batched step's.
        `kv_tokens`: the positions the slots' shared KV pool holds (bounded), or None (it grows as they need)."""
        self.model, self.provider, self.mode, self.max_context = model, provider, cfg.decode_mode, cfg.max_context
        self.budgeted = cfg.gpu_gb is not None  # batch graphs' memory is not in the plan: captured on first use
        self.device, self.dtype, self.max_rows, self.max_batch = device, dtype, max_rows, max_batch
        self.static = (device.type == "cuda" or max_rows > 1 or max_batch > 1) if static is None else static
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the first row's
        self.inputs: dict[tuple[int, bool], StepInputs] = {}
        # (rows, batched) -> its graph, its output buffers and the capacities of the states it was captured over
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, tuple]] = {}
        self.pieces: dict[tuple[int, bool], tuple[list, torch.Tensor, torch.Tensor, tuple]] = {}  # the same, in pieces
        self.graph_replays = 0
        self.slots: list[SequenceState] = []  # the static steps' own states, which the graphs read and write
        self.views: dict[int, SequenceState] = {}  # rows -> the batched view of the first slots' states
        self.kv_tokens, self.kv = kv_tokens, None  # the slots' KV pool (layers/kv.py), made with the first slot
        # the launched steps' tokens for the host and their events, two so that the next step's copy never meets the
        # one being read
        cuda = device.type == "cuda"
        self.picked = torch.zeros(2, max_batch, dtype=torch.long, pin_memory=cuda)
        self.picked_done = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self.launches = 0
        if self.static:
            self.slots.append(self._static_state())

    @property
    def state(self) -> SequenceState | None:
        """Slot 0's state: a lone sequence's, which the one-row and verify graphs step."""
        return self.slots[0] if self.slots else None

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The one-row step's graph."""
        return self.graphs[1, False][0] if (1, False) in self.graphs else None

    def new_state(self, slot: int = 0) -> SequenceState:
        """A state for a new sequence: with static steps batch slot `slot`'s own (reset), so that captured graphs
        serve every sequence; else a fresh one. A cache grown past `max_context` is made anew: its capacity sets the
        attention's split, so every sequence starts at the same one."""
        if not self.static:
            return self._new_state()
        while len(self.slots) <= slot:
            self.slots.append(self._static_state())
        if self.slots[slot].capacity != self.capacity:
            self.slots[slot].release()
            self.slots[slot] = self._static_state()
            self.graphs, self.pieces, self.views = {}, {}, {}  # they were captured over the old buffers
        self.slots[slot].reset()
        return self.slots[slot]

    def move(self, source: int, target: int) -> SequenceState:
        """Slot `source`'s sequence moved to slot `target` (its KV blocks handed over, its recurrent states
        copied); returns its state there."""
        state = self.new_state(target)
        state.load(self.slots[source])
        return state

    def step(self, token: int, state: SequenceState) -> torch.Tensor:
        """Feed one token; returns the next logits [vocab] (float32)."""
        if not self.static:
            with torch.inference_mode():
                return self.model.logits(self.model(torch.tensor([token], device=self.device), state))[0]
        logits = self.forward([token], state)[1]
        state.advance([token])
        return logits[0]

    @torch.inference_mode()
    def step_ahead(self, token: int | None, state: SequenceState, keep_hidden: bool = False) -> Ahead:
        """A greedy one-row step that the host need not wait for: of `token` after the state's, or (None) of the
        previous one's, still on the device, one position on; its logits' argmax becomes the next one's token there
        and is copied to the host (`Ahead.read`), so the GPU runs it while the host turns over the step before. The
        caller advances the state as it reads the tokens. Not for a model that stages host work before a step."""
        assert self.static
        start = state.length + (token is None)  # the step before is in flight: the state is a row behind
        capacity = self._make_room(state, start + 1)
        inputs = self._inputs(1, False)
        if token is not None:
            inputs.tokens.fill_(token)
        self.position.fill_(start)
        hidden, logits = self._step((1, False), [state], state, (capacity, self._grown()))
        return self._picked(inputs, logits, hidden.clone() if keep_hidden else None)

    @torch.inference_mode()
    def step_batch_ahead(self, tokens: list[int] | None, states: list[SequenceState]) -> Ahead:
        """`step_ahead` for several sequences: of `tokens[r]` after `states[r]`'s, or (None) of the previous batched
        step's tokens over the same states, one position on."""
        rows = len(states)
        assert self.static and 1 < rows <= self.max_batch
        inputs = self._inputs(rows, True)
        on = int(tokens is None)
        capacities = (*(self._make_room(state, state.length + on + 1) for state in states), self._grown())
        if tokens is None:
            inputs.positions.add_(1)
        else:
            self._load_batch(inputs, tokens, states)
        logits = self._step((rows, True), states, self._view(states), capacities)[1]
        return self._picked(inputs, logits, None)

    def _picked(self, inputs: StepInputs, logits: torch.Tensor, hidden: torch.Tensor | None) -> Ahead:
        """The step's argmax as the next step's tokens, and on their way to the host."""
        torch.argmax(logits, -1, out=inputs.tokens)
        which, self.launches = self.launches % 2, self.launches + 1
        picked, done = self.picked[which, :len(inputs.tokens)], self.picked_done[which]
        picked.copy_(inputs.tokens, non_blocking=True)
        if done is not None:
            done.record()
        return Ahead(picked, done, hidden)

    @torch.inference_mode()
    def forward(self, tokens: list[int], state: SequenceState, hidden: torch.Tensor | None = None,
                start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A static step of `tokens` at positions from `start` (default: after the state's; a verify step when
        there are several); returns their final hidden states [T, H] and logits [T, vocab] (float32). The caller
        advances the state (`state.advance`, or `state.accept` after a verify step). `hidden`: the MTP head's."""
        rows, start = len(tokens), state.length if start is None else start
        assert self.static and rows <= self.max_rows
        capacity = self._make_room(state, start + rows)
        inputs = self._inputs(rows, False)
        self._load(inputs, tokens, state, hidden)
        self.position.fill_(start)
        hidden, logits = self._step((rows, False), [state], state, (capacity, self._grown()))
        return hidden.clone(), logits.clone()  # a replay overwrites the graph's output buffers

    @torch.inference_mode()
    def step_batch(self, tokens: list[int], states: list[SequenceState]) -> torch.Tensor:
        """One token for each of several sequences, `tokens[r]` after `states[r]`'s, in one static step whose rows
        have the bits of single steps; returns their logits [rows, vocab] (float32) and advances the states."""
        rows = len(tokens)
        assert self.static and 1 < rows <= self.max_batch
        capacities = (*(self._make_room(state, state.length + 1) for state in states), self._grown())
        inputs = self._inputs(rows, True)
        self._load_batch(inputs, tokens, states)
        logits = self._step((rows, True), states, self._view(states), capacities)[1].clone()
        for state, token in zip(states, tokens):
            state.advance([token])
        return logits

    def _view(self, states: list[SequenceState]) -> SequenceState:
        """The rows' states layer by layer (layers/rows.py Batched); over the first slots, made once."""
        own = self._own(states)
        if own and len(states) in self.views:
            return self.views[len(states)]
        view = SequenceState([Batched(layers) for layers in zip(*(s.layers for s in states))])
        if own:
            self.views[len(states)] = view
        return view

    def _own(self, states: list[SequenceState]) -> bool:
        """Whether `states` are the first slots' (the graphs' and views' buffers), in order."""
        return len(states) <= len(self.slots) and all(s is slot for s, slot in zip(states, self.slots))

    def _make_room(self, state: SequenceState, end: int) -> int:
        """Room for positions up to `end` (a map that covers them, and their KV blocks); returns the state's
        capacity."""
        capacity = state.capacity
        if capacity < self.max_context:  # another state (tests): attended over as the decoder's own
            state.reserve(self.max_context)
            capacity = state.capacity
        if end > capacity:
            state.reserve(2 * max(capacity, end))
            capacity = state.capacity
        state.make_room(end)
        return capacity

    def _grown(self) -> int:
        """How often the KV pool's stores moved (graphs captured over older ones are made anew)."""
        return self.kv.grown if self.kv is not None else 0

    def _step(self, key: tuple[int, bool], states: list[SequenceState], view: SequenceState, capacities: tuple):
        """Replay the step's graph when it was captured over these states' buffers, else run it (and capture it
        when its rows are the first slots and every record is addressable); returns its hidden states and logits,
        which the next replay overwrites."""
        rows, batched = key
        own = self._own(states)
        addresses = self.provider.address_table() if self.mode != "handshake" else None
        captured = self.graphs.get(key)
        table = self.provider.piece_table(key[0]) if addresses is None and self.mode == "graph" and own else None
        if addresses is not None and own and captured is not None and captured[3] == capacities:
            graph, hidden, logits, _ = captured
            graph.replay()
            self.graph_replays += 1
        elif table is not None:
            hidden, logits = self._in_pieces(key, view, table, capacities)
        else:  # a graph over moved buffers (a state grew, or a prompt past max_context did) is captured anew
            hidden, logits = self._run(key, view, addresses)
            if addresses is not None and self.mode == "graph" and own:
                self._capture(key, view, addresses, capacities)  # after one eager run: compiled, allocated
        if addresses is not None:  # the provider saw none of this step's lookups
            self.provider.note_addressed(self._inputs(*key).routed)
        return hidden, logits

    def _in_pieces(self, key: tuple[int, bool], view: SequenceState, table, capacities: tuple):
        """The step's pieces replayed with the host's turn after each layer's routing; the first time (or over moved
        buffers) run eagerly the same way, then captured."""
        routed = self._inputs(*key).routed
        captured = self.pieces.get(key)
        if captured is None or captured[3] != capacities:
            hidden, logits = self._run(key, view, None, pieces=table)
            table.settle()
            self._capture_pieces(key, view, table, capacities)
            return hidden, logits
        pieces, hidden, logits, _ = captured
        for graph, cut in pieces:
            graph.replay()
            if cut is not None:
                layer, x = cut  # x: the layer's input, in the pieces' memory
                table.resolve(layer, routed[layer], x)
        table.settle()
        self.graph_replays += 1
        return hidden, logits

    def _capture_pieces(self, key: tuple[int, bool], view: SequenceState, table, capacities: tuple) -> None:
        graphs, ends, pool = [torch.cuda.CUDAGraph()], [], torch.cuda.graph_pool_handle()

        def cut(layer: int, x: torch.Tensor) -> None:  # a piece ends after the layer's routing; the next begins
            graphs[-1].capture_end()
            ends.append((layer, x))  # held: the pieces' pool keeps its memory for the replays' host turns
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool, capture_error_mode="thread_local")

        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)  # a capture runs off the default stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
            hidden, logits = self._run(key, view, None, pieces=table, cut=cut)
            graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pieces[key] = list(zip(graphs, [*ends, None])), hidden, logits, capacities

    def warm(self) -> None:
        """Run the static steps of every row count and batch size once (kernels compiled) and capture their graphs
        now, when the records are addressable, so that no request pays for either (batch graphs not under a GPU
        budget); the states are reset by the next `new_state`."""
        if not self.static:
            return
        with torch.inference_mode():
            self.position.fill_(0)
            for rows in range(1, self.max_rows + 1):
                key = (rows, False)
                self._run(key, self.state, None, scratch=True)
                addresses = self.provider.address_table() if self.mode == "graph" else None
                if addresses is not None:
                    self._run(key, self.state, addresses)
                    self._capture(key, self.state, addresses, (self.state.capacity, self._grown()))
                    self.graphs[key][0].replay()  # the first replay uploads the graph
            for rows in range(2, self.max_batch + 1):  # a first-use capture stalls every running sequence ~0.1 s
                if addresses is not None and not self.budgeted:
                    with torch.inference_mode(False):  # the slots' states outlive the warm-up
                        states = [self.new_state(slot) for slot in range(rows)]
                    key, view = (rows, True), self._view(states)
                    self._run(key, view, addresses)
                    self._capture(key, view, addresses, (*(s.capacity for s in states), self._grown()))
                    self.graphs[key][0].replay()
                else:  # compiled only: captured on first use
                    view = SequenceState([Batched([layer] * rows) for layer in self.state.layers])
                    self._run((rows, True), view, None, scratch=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, rows: int, batched: bool) -> StepInputs:
        """The step's device inputs; a batched step's positions are loaded per step, a verify step's follow the
        first row's."""
        if (rows, batched) not in self.inputs:
            offsets = torch.arange(rows, device=self.device)
            routed = torch.full((self.provider.geometry.num_layers, rows * self.model.config.num_experts_per_tok),
                                -1, dtype=torch.long, device=self.device)
            positions = self.position if rows == 1 else torch.zeros_like(offsets)
            self.inputs[rows, batched] = StepInputs(torch.zeros_like(offsets), positions, offsets, routed)
        return self.inputs[rows, batched]

    def _load(self, inputs: StepInputs, tokens: list[int], state: SequenceState, hidden) -> None:
        if len(tokens) == 1:
            self.model.stage_step(state.tokens, tokens[0])
            inputs.tokens.fill_(tokens[0])
        else:
            inputs.tokens.copy_(torch.tensor(tokens))

    def _load_batch(self, inputs: StepInputs, tokens: list[int], states: list[SequenceState]) -> None:
        inputs.tokens.copy_(torch.tensor(tokens))
        inputs.positions.copy_(torch.tensor([s.length for s in states]))

    def _forward(self, inputs: StepInputs, state: SequenceState, ctx: StepContext) -> torch.Tensor:
        return self.model(inputs.tokens, state, ctx)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _new_state(self) -> SequenceState:
        return self.model.new_state(self.dtype, self.device)

    def _run(self, key: tuple[int, bool], state: SequenceState, addresses: torch.Tensor | None,
             scratch: bool = False, pieces=None, cut=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The static step run (or captured); with `pieces` (experts/pieces.py), the host's turn after each layer's
        routing is `cut`, by default resolving the layer's records at once."""
        rows, batched = key
        inputs = self._inputs(rows, batched)
        if rows > 1 and not batched:  # inside a captured graph too: the rows' positions follow the device-side start
            torch.add(self.position, inputs.offsets, out=inputs.positions)
        if pieces is not None and cut is None:
            def cut(layer: int, x: torch.Tensor) -> None:
                pieces.resolve(layer, inputs.routed[layer], x)
        routed = inputs.routed if addresses is not None or pieces is not None else None
        experts = ExpertStep(addresses, routed, scratch=scratch, pieces=pieces, cut=cut)
        hidden = self._forward(inputs, state, StepContext(inputs.positions, static=True, experts=experts))
        return hidden, self._logits(hidden)

    def _capture(self, key: tuple[int, bool], state: SequenceState, addresses: torch.Tensor,
                 capacities: tuple) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden, logits = self._run(key, state, addresses)
        self.graphs[key] = graph, hidden, logits, capacities

    def _static_state(self) -> SequenceState:
        state = self._new_state()
        state.reserve(self.max_context)
        if self.kv is None and state.caches:
            stores = [KVRows(c.k.shape[1], c.k.shape[2], c.k.dtype, c.k.device) for c in state.caches]
            rows = self.kv_tokens or self.max_context
            self.kv = BlockPool(stores, blocks_for(rows), bounded=self.kv_tokens is not None)
        if self.kv is not None:
            state.share(self.kv)
        if self.max_rows > 1:
            state.reserve_rows(self.max_rows)
        self.capacity = state.capacity
        return state
