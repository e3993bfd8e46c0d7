"""Decode steps: one token (or a verify step's few) through the model's own forward.

On CUDA a step has static shapes: attention over a cache reserved to `max_context` rows masked by a device-side
position, recurrent states updated in place, experts one tile per routing entry, host work it needs (a PLE table's
rows on disk) staged before it. When every expert record is addressable without a host decision (all in the GPU
pool, or the rest read in place from the pinned host tier) the step is a CUDA graph of that forward, captured once
(at load) over the decoder's own sequence state, which every new sequence reuses; otherwise the step runs eagerly,
routing each layer through the host. Both give the same bits, so the output does not depend on what was resident.
A verify step (speculative decoding) is the same static step over k+1 rows, one graph per row count, whose rows
have the bits of single steps; the caller keeps a prefix of them (`SequenceState.accept`). On the CPU a step is
the plain eager forward, or the static one where verify steps are wanted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.config import EngineConfig
from moestream.experts.provider import ExpertProvider, ExpertStep
from moestream.layers.context import StepContext
from moestream.models.base import CausalLM, SequenceState


@dataclass
class StepInputs:
    """A static step's device inputs for `rows` token rows: what a captured graph reads and writes."""

    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]: the decoder's start position plus 0..rows-1
    offsets: torch.Tensor  # [rows]
    routed: torch.Tensor  # [record layers, rows * top_k] the routers' expert ids (-1: a layer the step skips)
    hidden: torch.Tensor | None = None  # [rows, H] the trunk's, for the MTP head's steps


class Decoder:
    def __init__(self, model: CausalLM, provider: ExpertProvider, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, static: bool | None = None, max_rows: int = 1):
        """`static`: whether steps have static shapes (default: on CUDA, when the model is graph-safe, or where
        verify steps are wanted; the CPU tests ask for them to run the GPU's step with the reference kernels).
        `max_rows`: the most rows a verify step has (1 + drafts)."""
        self.model, self.provider, self.mode, self.max_context = model, provider, cfg.decode_mode, cfg.max_context
        self.device, self.dtype, self.max_rows = device, dtype, max_rows
        self.static = (device.type == "cuda" or max_rows > 1) if static is None else static
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the first row's
        self.inputs: dict[int, StepInputs] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}  # rows -> its graph
        self.graph_replays = 0
        self.graph_capacity = None  # the state's capacity when the graphs were captured
        self.state = None  # the static steps' own state, which the graphs read and write
        if self.static:
            self.state = self._static_state()

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The one-row step's graph."""
        return self.graphs[1][0] if 1 in self.graphs else None

    def new_state(self) -> SequenceState:
        """A state for a new sequence: with static steps the decoder's own (reset), so one captured graph serves
        every sequence; else a fresh one. A cache grown past `max_context` is made anew: its capacity sets the
        attention's split, so every sequence starts at the same one."""
        if not self.static:
            return self._new_state()
        if self.state.capacity != self.capacity:
            self.state, self.graphs = self._static_state(), {}
        self.state.reset()
        return self.state

    def step(self, token: int, state: SequenceState) -> torch.Tensor:
        """Feed one token; returns the next logits [vocab] (float32)."""
        if not self.static:
            with torch.inference_mode():
                return self.model.logits(self.model(torch.tensor([token], device=self.device), state))[0]
        logits = self.forward([token], state)[1]
        state.advance([token])
        return logits[0]

    @torch.inference_mode()
    def forward(self, tokens: list[int], state: SequenceState, hidden: torch.Tensor | None = None,
                start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A static step of `tokens` at positions from `start` (default: after the state's; a verify step when
        there are several); returns their final hidden states [T, H] and logits [T, vocab] (float32). The caller
        advances the state (`state.advance`, or `state.accept` after a verify step). `hidden`: the MTP head's."""
        rows, start = len(tokens), state.length if start is None else start
        assert self.static and rows <= self.max_rows
        if state.capacity < self.max_context:  # another state (tests): attended over as the decoder's own
            state.reserve(self.max_context)
        if start + rows > state.capacity:
            state.reserve(2 * max(state.capacity, start + rows))
        if state is self.state and state.capacity != self.graph_capacity:
            self.graphs = {}  # their buffers moved: a step grew them, or a prompt past max_context did
        inputs = self._inputs(rows)
        self._load(inputs, tokens, state, hidden)
        self.position.fill_(start)
        addresses = self.provider.address_table() if self.mode != "handshake" else None
        if addresses is not None and rows in self.graphs and state is self.state:
            graph, hidden, logits = self.graphs[rows]
            graph.replay()
            self.graph_replays += 1
        else:
            hidden, logits = self._run(rows, state, addresses)
            if addresses is not None and self.mode == "graph" and state is self.state:
                self._capture(rows, addresses)  # after one eager run: compiled, allocated
        if addresses is not None:  # the provider saw none of this step's lookups
            self.provider.note_addressed(inputs.routed)
        return hidden.clone(), logits.clone()  # a replay overwrites the graph's output buffers

    def warm(self) -> None:
        """Run the static steps of every row count once (kernels compiled) and capture their graphs now, when the
        records are addressable, so that no request pays for either; the state is reset by the next `new_state`."""
        if not self.static:
            return
        with torch.inference_mode():
            self.position.fill_(0)
            for rows in range(1, self.max_rows + 1):
                self._run(rows, self.state, None, scratch=True)
                addresses = self.provider.address_table() if self.mode == "graph" else None
                if addresses is not None:
                    self._run(rows, self.state, addresses)
                    self._capture(rows, addresses)
                    self.graphs[rows][0].replay()  # the first replay uploads the graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, rows: int) -> StepInputs:
        if rows not in self.inputs:
            offsets = torch.arange(rows, device=self.device)
            routed = torch.full((self.provider.geometry.num_layers, rows * self.model.config.num_experts_per_tok),
                                -1, dtype=torch.long, device=self.device)
            positions = self.position if rows == 1 else torch.zeros_like(offsets)
            self.inputs[rows] = StepInputs(torch.zeros_like(offsets), positions, offsets, routed)
        return self.inputs[rows]

    def _load(self, inputs: StepInputs, tokens: list[int], state: SequenceState, hidden) -> None:
        if len(tokens) == 1:
            self.model.stage_step(state.tokens, tokens[0])
            inputs.tokens.fill_(tokens[0])
        else:
            inputs.tokens.copy_(torch.tensor(tokens))

    def _forward(self, inputs: StepInputs, state: SequenceState, ctx: StepContext) -> torch.Tensor:
        return self.model(inputs.tokens, state, ctx)

    def _new_state(self) -> SequenceState:
        return self.model.new_state(self.dtype, self.device)

    def _run(self, rows: int, state: SequenceState, addresses: torch.Tensor | None,
             scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self._inputs(rows)
        if rows > 1:  # inside a captured graph too: the rows' positions follow the device-side start
            torch.add(self.position, inputs.offsets, out=inputs.positions)
        experts = ExpertStep(addresses, inputs.routed if addresses is not None else None, scratch=scratch)
        hidden = self._forward(inputs, state, StepContext(inputs.positions, static=True, experts=experts))
        return hidden, self.model.logits(hidden)

    def _capture(self, rows: int, addresses: torch.Tensor) -> None:
        graph = torch.cuda.CUDAGraph()
        self.graph_capacity = self.state.capacity
        with torch.cuda.graph(graph):
            hidden, logits = self._run(rows, self.state, addresses)
        self.graphs[rows] = graph, hidden, logits

    def _static_state(self) -> SequenceState:
        state = self._new_state()
        state.reserve(self.max_context)
        if self.max_rows > 1:
            state.reserve_rows(self.max_rows)
        self.capacity = state.capacity
        return state
