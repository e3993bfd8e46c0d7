"""PLE (qwen4_exp): hashed n-gram embeddings injected into the hyper-connection streams of some layers.

For each token, every n-gram ending at it (orders 2..ngram_size) is hashed `heads_per_ngram` ways into
one shared table; the looked-up rows, concatenated, are projected to a value and to one key per stream.
The normalised streams gate the value (a signed-sqrt dot-product gate), and a dilated causal depthwise
conv over the gated values adds local context. The result [T, hc * H] is added to the streams: the forward
takes them with the previous block's injection still pending and returns the sum.

An n-gram never reaches across an EOS token: positions before the segment start read as EOS, and so
does everything before the first token. The table rows come through `table` (an `NgramTable` the loader
attaches: in pinned host memory, read in place by a kernel, or on disk, read row by row, a decode step's
staged before it runs); the module itself holds only the small hashing buffers. `PLEState` carries the
last `ngram_size - 1` ids and the conv history, updated in place, so prefill followed by single steps
equals one forward and a decode step can be captured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelConfig
from moestream.kernels import ops
from moestream.layers.linear import Linear, Projections
from moestream.layers.norm import RMSNorm
from moestream.layers.rows import RowCopies, reserve_rows, row_state


@dataclass
class PLEState:
    context: torch.Tensor  # [ngram_size - 1] the previous token ids (EOS before the first token)
    conv: torch.Tensor  # [(kernel - 1) * dilation, hc * H] the previous conv inputs (zeros at start)
    rows: RowCopies | None = None  # the states after each row of a verify step

    def reserve_rows(self, rows: int) -> None:
        self.rows = reserve_rows(self.rows, [self.context, self.conv], rows)

    def keep(self, row: int) -> None:
        if self.rows is not None:
            self.rows.keep(row)

    def rewind(self, row: int) -> None:
        self.rows.rewind(row)

    def snapshot(self) -> PLEState:
        return PLEState(self.context.clone(), self.conv.clone())

    def load(self, other: PLEState) -> None:
        self.context.copy_(other.context)
        self.conv.copy_(other.conv)

    def reset(self, eos: int) -> None:
        self.context.fill_(eos)
        self.conv.zero_()


class NgramEmbedding(nn.Module):
    """Token ids -> concatenated n-gram rows [T, ple_embed_dim]; buffers load from the store by name."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.ngram_size, self.heads_per_ngram = layer, cfg.ngram_size, cfg.heads_per_ngram
        self.eos = cfg.eos_token_ids[0]
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        self.head_dim = cfg.ple_embed_dim // heads
        self.register_buffer("layer_multipliers", torch.empty(cfg.ngram_size, dtype=torch.long))
        self.register_buffer("ngram_heads_vocab_sizes", torch.empty(heads, dtype=torch.long))
        self.register_buffer("ngram_heads_offsets", torch.empty(heads, dtype=torch.long))
        self.table = None  # NgramTable, attached by the loader
        self._host_hashing = None

    def ngram_ids(self, ids: torch.Tensor, context: torch.Tensor, hashing: tuple | None = None) -> torch.Tensor:
        """ids [T], context [ngram_size - 1] -> table row ids [T, heads] (ops.ngram_ids); `hashing`: (multipliers,
        head sizes, head offsets) where they are not the buffers (host copies)."""
        multipliers, sizes, offsets = hashing or (self.layer_multipliers, self.ngram_heads_vocab_sizes,
                                                  self.ngram_heads_offsets)
        return ops.ngram_ids(ids, context, multipliers, sizes, offsets, self.heads_per_ngram, self.eos)

    def stage_step(self, tokens: list[int], token: int) -> None:
        """Before a static step of `token` after `tokens`, with the table on disk: its rows read now into the
        table's device staging buffer, which the step (perhaps a graph replay) then reads."""
        table = self.table
        if table is None or table.host is not None:
            return
        if self._host_hashing is None:
            self._host_hashing = tuple(b.cpu() for b in (self.layer_multipliers, self.ngram_heads_vocab_sizes,
                                                         self.ngram_heads_offsets))
        context = ([self.eos] * (self.ngram_size - 1) + tokens[-(self.ngram_size - 1):])[-(self.ngram_size - 1):]
        row_ids = self.ngram_ids(torch.tensor([token]), torch.tensor(context), self._host_hashing)
        raw, inverse = table.read(row_ids[0])
        table.stage(raw[inverse])

    def forward(self, ids: torch.Tensor, context: torch.Tensor, dtype: torch.dtype, static: bool = False
                ) -> torch.Tensor:
        """ids [T] -> [T, heads * head_dim] in `dtype`; a static step's rows from the host tier in place, or from
        the staging buffer `stage_step` filled."""
        table = self.table
        if table is None:
            raise RuntimeError(f"layer {self.layer}: no n-gram table attached (load the model through a store)")
        if table.host is None and static:
            return ops.ngram_rows(table.staging, table.staging_ids, table.layout, dtype).flatten(-2)
        row_ids = self.ngram_ids(ids, context)  # [T, heads]
        if table.host is not None:
            table.host_rows.add_(row_ids.numel())
            rows = ops.ngram_rows(table.host, row_ids, table.layout, dtype)
        else:
            raw, inverse = table.read(row_ids)
            rows = ops.ngram_rows(raw.to(ids.device), inverse.to(ids.device), table.layout, dtype)
        return rows.flatten(-2)


class PLE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.streams, self.hidden = cfg.hc_count, cfg.hidden_size
        width = self.streams * self.hidden
        self.ple_embedding = NgramEmbedding(cfg, layer)
        self.key_proj = Linear(cfg.ple_embed_dim, width, bias=False)
        self.value_proj = Linear(cfg.ple_embed_dim, self.hidden, bias=False)
        self.from_rows = Projections(self.key_proj, self.value_proj)
        self.norm_key = RMSNorm(width, cfg.rms_norm_eps, zero_centered=True, group_size=self.hidden)
        self.norm_query = RMSNorm(width, cfg.rms_norm_eps, zero_centered=True, group_size=self.hidden)
        self.norm_conv = RMSNorm(width, cfg.rms_norm_eps, zero_centered=True, group_size=self.hidden)
        self.dilation = cfg.ngram_size
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(width, 1, cfg.ple_conv_kernel_size))
        self.history = (cfg.ple_conv_kernel_size - 1) * self.dilation

    def fuse_projections(self) -> None:
        self.from_rows.fuse()

    def new_state(self, dtype: torch.dtype, device: torch.device) -> PLEState:
        context = torch.full((self.ple_embedding.ngram_size - 1,), self.ple_embedding.eos, dtype=torch.long,
                             device=device)
        return PLEState(context, torch.zeros(self.history, self.streams * self.hidden, dtype=dtype, device=device))

    def forward(self, residual: tuple, ids: torch.Tensor, state: PLEState, static: bool = False) -> torch.Tensor:
        """residual (streams [T, hc * H], a block's output [T, H] pending at its weights [T, hc], or None, None), ids
        [T] -> the streams with that injection (done in the query norm's launch) and the PLE update added; advances
        `state`. A static step of several rows runs them one by one: a verify step's keeping the state after each, a
        batched step's each on its own sequence's state."""
        if static and ids.shape[0] > 1:
            out = []
            for r in range(ids.shape[0]):
                row = tuple(None if part is None else part[r: r + 1] for part in residual)
                out.append(self(row, ids[r: r + 1], row_state(state, r), static))
                state.keep(r)
            return torch.cat(out)
        streams, queries = self.norm_query.after_inject(*residual)
        embedded = self.ple_embedding(ids, state.context, streams.dtype, static)  # [T, ple_embed_dim]
        state.context.copy_(torch.cat([state.context, ids])[ids.shape[0]:])
        keys, values = self.from_rows.parts(embedded)
        keys = self.norm_key(keys).unflatten(-1, (self.streams, self.hidden))
        queries = queries.unflatten(-1, (self.streams, self.hidden))
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)  # [T, hc, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * values.unsqueeze(-2)).flatten(-2)  # [T, hc * H]
        return streams + (gated + self._conv(self.norm_conv(gated), state))

    def _conv(self, x: torch.Tensor, state: PLEState) -> torch.Tensor:
        """Dilated causal depthwise conv + SiLU over x [T, C], continuing from the state's history."""
        full = torch.cat([state.conv.to(x.dtype), x])  # [history + T, C]
        state.conv.copy_(full[full.shape[0] - self.history:])
        out = F.conv1d(full.T[None], self.conv1d.weight.to(x.dtype), groups=x.shape[1], dilation=self.dilation)
        return F.silu(out[0].T)
