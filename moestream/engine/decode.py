"""Decode steps: one token through the model's own forward.

On CUDA a step has static shapes: attention over a cache reserved to `max_context` rows masked by a device-side
position, recurrent states updated in place, experts one tile per routing entry, host work it needs (a PLE table's
rows on disk) staged before it. When every expert record is addressable without a host decision (all in the GPU
pool, or the rest read in place from the pinned host tier) the step is a CUDA graph of that forward, captured once
(at load) over the decoder's own sequence state, which every new sequence reuses; otherwise the step runs eagerly,
routing each layer through the host. Both give the same bits, so the output does not depend on what was resident.
On the CPU a step is the plain eager forward.
"""

from __future__ import annotations

import torch

from moestream.config import EngineConfig
from moestream.experts.provider import ExpertProvider, ExpertStep
from moestream.layers.context import StepContext
from moestream.models.base import CausalLM, SequenceState


class Decoder:
    def __init__(self, model: CausalLM, provider: ExpertProvider, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, static: bool | None = None):
        """`static`: whether steps have static shapes (default: on CUDA, when the model is graph-safe; the CPU
        tests ask for them to run the GPU's step with the reference kernels)."""
        self.model, self.provider, self.mode, self.max_context = model, provider, cfg.decode_mode, cfg.max_context
        self.device, self.dtype = device, dtype
        self.static = device.type == "cuda" if static is None else static
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.routed = torch.zeros(len(model.moe_blocks()), model.config.num_experts_per_tok, dtype=torch.long,
                                  device=device)
        self.graph, self.logits, self.graph_replays = None, None, 0
        self.graph_capacity = None  # the state's capacity when the graph was captured
        self.state = None  # the static steps' own state, which the graph reads and writes
        if self.static:
            self.state = self._static_state()

    def new_state(self) -> SequenceState:
        """A state for a new sequence: with static steps the decoder's own (reset), so one captured graph serves
        every sequence; else a fresh one. A cache grown past `max_context` is made anew: its capacity sets the
        attention's split, so every sequence starts at the same one."""
        if not self.static:
            return self.model.new_state(self.dtype, self.device)
        if self.state.capacity != self.capacity:
            self.state, self.graph = self._static_state(), None
        self.state.reset()
        return self.state

    @torch.inference_mode()
    def step(self, token: int, state: SequenceState) -> torch.Tensor:
        """Feed one token; returns the next logits [vocab] (float32)."""
        if not self.static:
            return self.model.logits(self.model(torch.tensor([token], device=self.device), state))[0]
        if state.capacity < self.max_context:  # another state (tests): attended over as the decoder's own
            state.reserve(self.max_context)
        if state.length >= state.capacity:
            state.reserve(2 * state.capacity)
        if state is self.state and state.capacity != self.graph_capacity:
            self.graph = None  # its buffers moved: a step grew them, or a prompt past max_context did
        self.model.stage_step(state.tokens, token)
        self.token.fill_(token)
        self.position.fill_(state.length)
        addresses = self.provider.address_table() if self.mode != "handshake" else None
        if addresses is not None and self.graph is not None and state is self.state:
            self.graph.replay()
            self.graph_replays += 1
            logits = self.logits
        else:
            logits = self._run(state, addresses)
            if addresses is not None and self.mode == "graph" and state is self.state:
                self._capture(addresses)  # after one eager run: compiled, allocated
        if addresses is not None:  # the provider saw none of this step's lookups
            self.provider.note_addressed(self.routed)
        state.advance([token])
        return logits[0].clone()  # a replay overwrites the graph's output buffer

    def warm(self) -> None:
        """Run the static step once (kernels compiled) and capture the graph now, when the records are addressable,
        so that no request pays for either; the state is reset by the next `new_state`."""
        if not self.static:
            return
        with torch.inference_mode():
            self.position.fill_(0)
            self._run(self.state, None, scratch=True)
            addresses = self.provider.address_table() if self.mode == "graph" else None
            if addresses is not None:
                self._run(self.state, addresses)
                self._capture(addresses)
                self.graph.replay()  # the first replay uploads the graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run(self, state: SequenceState, addresses: torch.Tensor | None, scratch: bool = False) -> torch.Tensor:
        experts = ExpertStep(addresses, self.routed if addresses is not None else None, scratch=scratch)
        ctx = StepContext(self.position, static=True, experts=experts)
        return self.model.logits(self.model(self.token, state, ctx))

    def _capture(self, addresses: torch.Tensor) -> None:
        self.graph, self.graph_capacity = torch.cuda.CUDAGraph(), self.state.capacity
        with torch.cuda.graph(self.graph):
            self.logits = self._run(self.state, addresses)

    def _static_state(self) -> SequenceState:
        state = self.model.new_state(self.dtype, self.device)
        state.reserve(self.max_context)
        self.capacity = state.capacity
        return state
