"""The decoder shared by every Qwen MoE type, configured by a small spec per model type.

Module names follow the checkpoints (`model.layers.N.self_attn.q_proj`, `mlp.gate`, `lm_head`), so the
store's dense tensors load by name. `CausalLM.forward` is the one per-layer loop: what prefill runs, what a
decode step runs and what a CUDA graph captures. A backbone says how the residual is carried between layers
(one stream with each add done in the next norm's launch; qwen4_exp: hyper-connection streams).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.attention import Attention
from moestream.layers.context import StepContext
from moestream.layers.deltanet import GatedDeltaNet
from moestream.layers.kv import BlockPool, BlockTable, blocks_for
from moestream.layers.linear import Linear
from moestream.layers.mlp import MLP
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import Rotary


@dataclass(frozen=True)
class ModelSpec:
    zero_centered_norms: bool = False  # (1 + w) RMSNorm (qwen3_next family)
    qk_norm: bool = True
    attention_output_gate: bool = False
    fused_qkvz: bool = False  # qwen3_next's DeltaNet projection layout
    deltanet_gate: str = "silu"
    shared_expert: bool = False


@dataclass
class SequenceState:
    """Everything a sequence carries between forwards: per-layer caches and the tokens so far; with MTP drafting,
    the head's own state as `draft` (its length trails the trunk's: the head steps after it)."""

    layers: list
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    draft: SequenceState | None = None
    table: BlockTable | None = field(default=None, repr=False, compare=False)  # its caches' one table (`share`)

    def snapshot(self, shared: bool = False) -> SequenceState:
        """A copy of what it holds; `shared`: its attention caches' rows stay in their pool's blocks, held for the
        snapshot (its keeper gives them back: `snapshot_blocks`)."""
        blocks = self.table.shared(self.length) if shared else None
        layers = [s.snapshot(blocks) if blocks is not None and hasattr(s, "reserve") else s.snapshot()
                  for s in self.layers]
        return SequenceState(layers, self.length, list(self.tokens),
                             self.draft.snapshot() if self.draft is not None else None)

    def keeps_rows_in(self, pool: BlockPool | None) -> bool:
        """Whether its attention caches keep their rows in `pool`, through its one table (`share`)."""
        return pool is not None and self.table is not None and self.table.pool is pool

    def snapshot_blocks(self) -> list[int]:
        """The pool blocks a shared snapshot holds (none for a copied one)."""
        return next((s.blocks for s in self.layers if getattr(s, "blocks", None) is not None), [])

    def load(self, other: SequenceState) -> None:
        """Become `other` (a snapshot, perhaps on the host), copying into this state's own buffers."""
        for s, o in zip(self.layers, other.layers):
            s.load(o)
        self.length, self.tokens = other.length, list(other.tokens)
        if self.draft is not None and other.draft is not None:
            self.draft.load(other.draft)

    @functools.cached_property
    def caches(self) -> list:
        """Its attention layers' caches (the layers' states never change, only what they hold)."""
        return [s for s in self.layers if hasattr(s, "reserve")]

    @property
    def capacity(self) -> int:
        """Positions its attention caches' row maps cover (static decode's shapes follow them)."""
        if self.table is not None:
            return self.table.capacity
        return min((c.capacity for c in self.caches), default=1 << 62)

    def reserve(self, rows: int) -> None:
        for c in self.caches:
            c.reserve(rows)

    def make_room(self, end: int) -> None:
        """KV blocks for positions up to `end` (a batched step asks 48 layers of 16 sequences each step: with one
        table there is nothing to do while it has them)."""
        table = self.table
        if table is not None and end <= table.capacity and blocks_for(end) <= len(table.blocks):
            return
        for c in self.caches:
            c.make_room(end)

    def share(self, pool: BlockPool) -> None:
        """Keep its attention caches' rows in `pool`'s stores (one per cache, in order), through one block table."""
        if self.caches:
            self.table = BlockTable(pool, self.caches[0].row_map.device, self.capacity)
            for cache, store in zip(self.caches, pool.stores):
                cache.share(store, self.table)

    def release(self) -> None:
        """Its KV blocks go back to their pool (the sequence ended)."""
        for c in self.caches:
            c.table.release()

    def reset(self) -> None:
        """Empty, keeping its buffers (a captured graph reads them)."""
        for s in self.layers:
            s.reset()
        self.length, self.tokens = 0, []
        if self.draft is not None:
            self.draft.reset()

    def reserve_rows(self, rows: int) -> None:
        """Room for the recurrent states after each row of a verify step of `rows` rows (layers/rows.py)."""
        for s in self.layers:
            if hasattr(s, "reserve_rows"):
                s.reserve_rows(rows)

    def accept(self, tokens: list[int], rows: int) -> None:
        """After a verify step of `rows` rows, the first len(tokens) are the sequence's: the caches keep them and
        the recurrent states go back to after the last of them."""
        if len(tokens) < rows:
            for s in self.layers:
                if hasattr(s, "rewind"):
                    s.rewind(len(tokens) - 1)
        self.advance(tokens)

    def advance(self, tokens: list[int]) -> None:
        """The step that wrote these tokens' caches is done: they are part of the sequence now."""
        for s in self.layers:
            s.advance(len(tokens))
        self.length += len(tokens)
        self.tokens.extend(tokens)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec, index: int, layer_slot: int | None, kind: str | None = None):
        super().__init__()
        self.kind = kind or cfg.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, spec.fused_qkvz, spec.deltanet_gate)
        else:
            self.self_attn = Attention(cfg, spec.qk_norm, spec.attention_output_gate, spec.zero_centered_norms)
        if layer_slot is None:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = SparseMoE(cfg, layer_slot, spec.shared_expert)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def new_state(self, dtype: torch.dtype, device: torch.device):
        return self.mixer.new_state(dtype, device)

    def mix(self, x: torch.Tensor, rope, state, ctx: StepContext) -> torch.Tensor:
        if self.kind == "linear_attention":
            return self.linear_attn(x, state, ctx)
        return self.self_attn(x, rope, state, ctx)

    def forward(self, residual: tuple, ids: torch.Tensor, rope, state, ctx: StepContext) -> tuple:
        """residual (x [T, H], the last block's output not yet added to it, or None) -> the same after this layer;
        each add (and the MoE block's combine) runs in the launch of the norm after it."""
        x, h = self.input_layernorm.after(*residual)
        x, h = self.post_attention_layernorm.after(x, self.mix(h, rope, state, ctx))
        return x, self.mlp(h, ctx, deferred=True) if isinstance(self.mlp, SparseMoE) else self.mlp(h, ctx)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        slots = {layer: s for s, layer in enumerate(cfg.moe_layer_ids)}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i, slots.get(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.zero_centered_norms)

    def begin(self, x: torch.Tensor) -> tuple:
        return x, None

    def end(self, residual: tuple) -> torch.Tensor:
        return self.norm.after(*residual)[1]

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of the trunk's output (`end`'s): here the output itself."""
        return hidden


class CausalLM(nn.Module):
    spec = ModelSpec()
    backbone_class = Backbone
    mtp_head: type | None = None  # the MTP head's module; None: Qwen3-Next's layout (models/mtp.py `head_class`)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.backbone_class(cfg, self.spec)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # a few rows' bits independent of how many
        self.rotary = Rotary(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta)
        self._stagers = None

    def stage_step(self, tokens: list[int], token: int) -> None:
        """Host work a static decode step of `token` after `tokens` needs before it runs (the PLE rows of a table
        on disk)."""
        if self._stagers is None:
            self._stagers = [m for m in self.modules() if m is not self and hasattr(m, "stage_step")]
        for module in self._stagers:
            module.stage_step(tokens, token)

    @functools.cached_property
    def pads_prompts(self) -> bool:
        """Whether rows after a prompt's own change nothing of them (layers/context.py Padding): causal attention in
        every layer, and nothing carried along the rows (no DeltaNet state, PLE context or hyper-connection)."""
        return type(self.model) is Backbone and all(type(layer.mixer) is Attention for layer in self.model.layers)

    def moe_blocks(self, mtp: bool = False) -> list[SparseMoE]:
        """The trunk's MoE blocks in layer order (the decode step's), then the MTP head's with `mtp`."""
        heads = (self.mtp,) if mtp and hasattr(self, "mtp") else ()
        return [m for part in (self.model, *heads) for m in part.modules() if isinstance(m, SparseMoE)]

    def new_state(self, dtype: torch.dtype, device: torch.device) -> SequenceState:
        return SequenceState([layer.new_state(dtype, device) for layer in self.model.layers])

    @property
    def hidden_width(self) -> int:
        """The width of `forward`'s rows: H, or hc * H where the residual is hyper-connection streams."""
        return self.config.hidden_size * self.config.hc_count

    def forward(self, ids: torch.Tensor, state: SequenceState, ctx: StepContext | None = None) -> torch.Tensor:
        """ids [T] -> the trunk's final hidden states [T, hidden_width] (what `logits` and the MTP head read); writes
        the step's caches into `state`. Without `ctx`, an eager step after the state's tokens, which then advances
        the state; with one (the engine's steps, which a graph may replay), the caller advances it."""
        eager = ctx is None
        ctx = ctx or StepContext.eager(state.length, ids.shape[0], ids.device)
        x = self.model.embed_tokens(ids)
        rope = self.rotary.cos_sin(ctx.positions, x.dtype)
        residual = self.model.begin(x)
        for layer, layer_state in zip(self.model.layers, state.layers):
            residual = layer(residual, ids, rope, layer_state, ctx)
        if eager:
            state.advance(ids.tolist())
        return self.model.end(residual)

    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: SequenceState,
              ctx: StepContext | None = None) -> torch.Tensor:
        """The MTP head: trunk outputs hidden [T, hidden_width] at t and the tokens x[t+1] [T] -> the head's output
        [T, hidden_width], for `draft_logits` (the guess at x[t+2]) and for the next chained step; `state` is the
        head's own (`mtp.new_state`), stepped as `forward` steps the trunk's."""
        eager = ctx is None
        ctx = ctx or StepContext.eager(state.length, next_ids.shape[0], next_ids.device)
        x = self.model.embed_tokens(next_ids)
        out = self.mtp(hidden, x, next_ids, self.rotary.cos_sin(ctx.positions, x.dtype), state, ctx)
        if eager:
            state.advance(next_ids.tolist())
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.head_input(hidden)).float()

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The MTP head's logits from its output (`draft`'s), through the trunk's LM head."""
        return self.lm_head(self.mtp.head_input(out)).float()
