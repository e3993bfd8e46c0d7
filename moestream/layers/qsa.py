"""QSA indexed sparse attention (qwen4_exp): each query attends to at most `budget + ratio - 1` tokens.

Index keys of every `ratio` consecutive tokens are averaged into one block key (then normed and rotated
at the block's first position). A query at position p scores the blocks complete by p,
`sum_heads relu(q_h . key_b) / sqrt(d)`, keeps the `budget / ratio` best, and attends to their tokens
plus the tail of its incomplete block (tokens `ratio * complete .. p`). While every query can see at most
`budget + ratio - 1` tokens this is plain causal attention.

A prefill attends over every key with its queries' selections as a mask (chunked to bound memory), so each
key is read once, not once for each query that chose it. Eager selection is vectorised over queries. Where
the k-th and (k+1)-th best scores tie exactly (with few indexer heads, when relu zeroes several blocks) it
resolves them as the reference's `torch.topk` over the query's complete blocks does. The static step (one
token, captured in CUDA graphs) scores every block the reserved cache can hold, masked by the device-side
position, and breaks such ties by the lower block index, since no host decision may run there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from moestream.config import ModelConfig
from moestream.kernels import ops, reference
from moestream.layers.attention import PREFILL_BACKENDS, Attention, causal_attention
from moestream.layers.context import StepContext
from moestream.layers.kv import KVCache, KVSnapshot
from moestream.layers.linear import Linear
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import Rotary, apply_rotary
from moestream.layers.rows import row_state

QUERY_CHUNK_ELEMENTS = 1 << 26  # mask elements (queries x keys) per chunk of a prefill


class QSACache(KVCache):
    """KV cache (paged) plus the indexer's raw key of every position [capacity, Di] and the key of every complete
    block [capacity // ratio + 1, Di], kept in place; the last block row takes a static step's write while its
    block is incomplete."""

    def __init__(self, kv_heads: int, head_dim: int, index_dim: int, ratio: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 64):
        super().__init__(kv_heads, head_dim, dtype, device, capacity)
        self.ratio = ratio
        self.index_keys = torch.zeros(capacity, index_dim, dtype=dtype, device=device)
        self.block_keys = torch.zeros(capacity // ratio + 1, index_dim, dtype=dtype, device=device)

    def reserve(self, capacity: int) -> None:
        super().reserve(capacity)
        self._fit()

    def make_room(self, end: int) -> None:
        super().make_room(end)
        self._fit()  # the row map is the sequence's: another layer's cache may have grown it

    def _fit(self) -> None:
        rows = self.capacity
        if self.index_keys.shape[0] < rows:
            self.index_keys = _grown(self.index_keys, rows)
            self.block_keys = _grown(self.block_keys, rows // self.ratio + 1)

    @torch.inference_mode()  # keys grown in a forward are inference tensors
    def load(self, other: QSACache | QSASnapshot) -> None:
        super().load(other)
        blocks = other.length // self.ratio
        self.index_keys[: other.length].copy_(other.index_keys[: other.length])
        self.block_keys[:blocks].copy_(other.block_keys[:blocks])

    def snapshot(self, blocks: list[int] | None = None) -> QSASnapshot:
        base = super().snapshot(blocks)
        return QSASnapshot(base.k, base.v, base.length, base.capacity, base.blocks,
                           self.index_keys[: self.length].clone(), self.block_keys[: self.length // self.ratio].clone())


@dataclass
class QSASnapshot(KVSnapshot):
    index_keys: torch.Tensor
    block_keys: torch.Tensor


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if rows <= t.shape[0] else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.budget = cfg.indexer_compress_ratio, cfg.indexer_budget
        self.block_topk = self.budget // self.ratio
        self.index_qk_proj = Linear(cfg.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps, zero_centered=True)
        self.rotary = Rotary(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta)  # block keys' positions

    def queries_and_keys(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> index queries [T, Hi, Di] (normed, rotated) and raw index keys [T, Di]."""
        q, raw_keys = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        return apply_rotary(self.q_layernorm(q.view(x.shape[0], self.heads, self.dim)), *rope), raw_keys

    def block_keys(self, raw: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """raw index keys [n, ratio, Di] of n blocks starting at `starts` [n] -> their block keys [n, Di]."""
        pooled = raw.float().mean(dim=1).to(raw.dtype)
        cos, sin = self.rotary.cos_sin(starts, raw.dtype)
        return apply_rotary(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0]

    def forward(self, x: torch.Tensor, rope, cache: QSACache) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] after the cache's `length` -> index queries and every complete block key [blocks, Di]."""
        start, end = cache.length, cache.length + x.shape[0]
        q, raw_keys = self.queries_and_keys(x, rope)
        cache.make_room(end)
        cache.index_keys[start:end] = raw_keys
        first, complete = start // self.ratio, end // self.ratio
        if complete > first:
            raw = cache.index_keys[first * self.ratio: complete * self.ratio].view(-1, self.ratio, self.dim)
            starts = torch.arange(first, complete, device=x.device) * self.ratio
            cache.block_keys[first:complete] = self.block_keys(raw, starts)
        return q, cache.block_keys[:complete]

    def static_step(self, x: torch.Tensor, rope, positions: torch.Tensor, cache: QSACache, row: int) -> torch.Tensor:
        """Row `row` of tokens x [T, H] at device-side `positions` [T]: its raw key stored, and the key of the block
        it completes written, with fixed shapes. Returns its index queries [1, Hi, Di]."""
        cos, sin = (part[row: row + 1] for part in rope)
        q, raw_key = self.queries_and_keys(x[row: row + 1], (cos, sin))
        ops.qsa_block_key(cache.index_keys, cache.block_keys, raw_key, positions[row: row + 1], self.ratio,
                          self.k_layernorm.weight, self.k_layernorm.eps, self.rotary.inv_freq)
        return q

    def scores(self, q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """q [T, Hi, Di], blocks [B, Di] -> [T, B] float32, each >= 0."""
        return reference.qsa_scores(q, blocks)

    def select(self, q: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor):
        """q [T, Hi, Di], blocks [B, Di], positions [T] -> token ids [T, S] and their validity [T, S]."""
        complete = (positions + 1) // self.ratio  # blocks each query may choose from (a prefix)
        scores = self.scores(q, blocks)
        k = min(self.block_topk, blocks.shape[0])
        allowed = torch.arange(blocks.shape[0], device=q.device)[None] < complete[:, None]
        top = scores.masked_fill(~allowed, float("-inf")).topk(min(k + 1, blocks.shape[0]), dim=-1)
        chosen, chosen_ok = top.indices[:, :k], top.values[:, :k] > float("-inf")
        if top.values.shape[1] > k:
            tied = (complete > k) & (top.values[:, k - 1] == top.values[:, k])
            for n in torch.unique(complete[tied]).tolist():  # rare: resolve as topk over the prefix does
                rows = torch.nonzero(tied & (complete == n)).flatten()
                chosen[rows] = scores[rows, :n].topk(k, dim=-1).indices
        return self._tokens(chosen, chosen_ok, complete, positions, blocks.shape[0])

    def select_static(self, q: torch.Tensor, blocks: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`select` for one query at device-side `position` [1] over every block row the cache can hold [B, Di],
        with fixed shapes; exact ties go to the lower block index. Returns the cache rows [S], -1 for none."""
        return ops.qsa_rows(ops.qsa_scores(q, blocks), position, self.ratio, self.block_topk)

    def _tokens(self, chosen, chosen_ok, complete, positions, blocks: int):
        """Chosen blocks [T, k] (valid where chosen_ok) -> token ids [T, S] and their validity, blocks in order."""
        chosen = torch.where(chosen_ok, chosen, blocks).sort(dim=-1).values  # invalid ones last
        offsets = torch.arange(self.ratio, device=chosen.device)
        block_tokens = (chosen[:, :, None] * self.ratio + offsets).flatten(1)  # [T, k * ratio]
        tail = complete[:, None] * self.ratio + offsets[: self.ratio - 1]  # [T, ratio - 1]
        ids = torch.cat([block_tokens, tail], dim=1)
        ok = torch.cat([(chosen < blocks).repeat_interleave(self.ratio, dim=1), tail <= positions[:, None]], dim=1)
        return ids.clamp_max(positions.max()), ok


class IndexedAttention(Attention):
    """Gated attention (zero-centred q/k norms) whose queries see only the tokens the indexer selects."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qk_norm=True, output_gate=True, zero_centered=True)
        self.indexer = Indexer(cfg)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> QSACache:
        return QSACache(self.kv_heads, self.head_dim, self.indexer.dim, self.indexer.ratio, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: QSACache,
                ctx: StepContext) -> torch.Tensor:
        if ctx.static:
            return self._static(x, rope, ctx.positions, cache)
        t, start = x.shape[0], cache.length
        index_q, blocks = self.indexer(x, rope, cache)
        q, k, v, gate = self.project(x, rope)
        keys, values = cache.append(k, v)
        scale = self.head_dim ** -0.5
        if keys.shape[0] < self.indexer.budget + self.indexer.ratio:  # every visible token is selected
            return self.finish(causal_attention(q, keys, values, scale), gate)
        positions = torch.arange(start, start + t, device=x.device)
        chunk = max(1, QUERY_CHUNK_ELEMENTS // keys.shape[0])
        groups = self.heads // self.kv_heads  # a masked SDPA with GQA may take the math kernel: expand instead
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = []
        for i in range(0, t, chunk):
            ids, ok = self.indexer.select(index_q[i: i + chunk], blocks, positions[i: i + chunk])
            out.append(_attend_masked(q[i: i + chunk], ids, ok, keys, values, scale))
        return self.finish(torch.cat(out), gate)

    def _static(self, x: torch.Tensor, rope, positions: torch.Tensor, cache: QSACache) -> torch.Tensor:
        """Tokens at device-side `positions` [T] with fixed shapes (captured in the decode graph); a verify step's
        rows one by one, each as a decode step selects and attends."""
        qkv, (cos, sin) = self.qkv(x), rope
        out = []
        for r in range(x.shape[0]):
            row, at, kv = qkv[r: r + 1], positions[r: r + 1], row_state(cache, r)
            q = ops.qk_norm_rope_cache(row, self.heads, self.kv_heads, self.head_dim, *self._norms(), cos[r: r + 1],
                                       sin[r: r + 1], kv.k, kv.v, at, kv.row_map)
            index_q = self.indexer.static_step(x, rope, positions, kv, r)
            rows = self.indexer.select_static(index_q, kv.block_keys[:-1], at)
            out.append(ops.decode_attention(q, kv.k, kv.v, at, self.head_dim ** -0.5, rows, self.gate_heads(row),
                                            kv.row_map))
        return self.o_proj(torch.cat(out).reshape(x.shape[0], -1))


def _attend_masked(q, ids, ok, keys, values, scale) -> torch.Tensor:
    """Queries q [T, Hq, D], each over every row of keys, values [L, Hq, D] with its selection (ids [T, S],
    valid where `ok`) as a mask, which reads each key once where gathering them read it once a query that chose it."""
    mask = torch.zeros(q.shape[0], keys.shape[0] + 1, dtype=torch.bool, device=q.device)
    mask = mask.scatter(1, torch.where(ok, ids, keys.shape[0]), True)[:, :-1]  # unselected ids land in the spare
    with sdpa_kernel(PREFILL_BACKENDS) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=mask[None, None], scale=scale)
    return out[0].transpose(0, 1)
