"""QSA indexed sparse attention (qwen4_exp): each query attends to at most `budget + ratio - 1` tokens.

Index keys of every `ratio` consecutive tokens are averaged into one block key (then normed and rotated
at the block's first position). A query at position p scores the blocks complete by p,
`sum_heads relu(q_h . key_b) / sqrt(d)`, keeps the `budget / ratio` best, and attends to their tokens
plus the tail of its incomplete block (tokens `ratio * complete .. p`). While every query can see at most
`budget + ratio - 1` tokens this is plain causal attention.

Selection is vectorised over queries (chunked to bound memory). Where the k-th and (k+1)-th best scores
tie exactly, the choice is `torch.topk` over the query's complete blocks, as in the reference; this
happens with few indexer heads, when relu zeroes several blocks. `QSACache` keeps, besides K and V,
the block keys of complete blocks and the raw index keys of the incomplete last block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelConfig
from moestream.layers.attention import Attention, KVCache, causal_attention
from moestream.layers.context import StepContext
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import Rotary, apply_rotary

QUERY_CHUNK_ELEMENTS = 1 << 24  # gathered K/V elements per chunk of queries


class QSACache(KVCache):
    """KV cache plus the indexer's state: block keys [blocks, Di] and pending raw index keys [< ratio, Di]."""

    def __init__(self, kv_heads: int, head_dim: int, index_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(kv_heads, head_dim, dtype, device)
        self.block_keys = torch.empty(64, index_dim, dtype=dtype, device=device)
        self.num_blocks = 0
        self.pending = torch.empty(0, index_dim, dtype=dtype, device=device)

    def add_blocks(self, keys: torch.Tensor) -> torch.Tensor:
        """Appends block keys [n, Di]; returns every block key so far."""
        end = self.num_blocks + keys.shape[0]
        if end > self.block_keys.shape[0]:
            grown = self.block_keys.new_empty(max(end, 2 * self.block_keys.shape[0]), self.block_keys.shape[1])
            grown[: self.num_blocks] = self.block_keys[: self.num_blocks]
            self.block_keys = grown
        self.block_keys[self.num_blocks: end] = keys
        self.num_blocks = end
        return self.block_keys[:end]

    def load(self, other: QSACache) -> None:
        super().load(other)
        self.num_blocks = 0
        self.add_blocks(other.block_keys[: other.num_blocks].to(self.block_keys.device))
        self.pending = other.pending.to(self.pending.device).clone()

    def snapshot(self) -> QSACache:
        out = QSACache.__new__(QSACache)
        base = super().snapshot()
        out.k, out.v, out.length = base.k, base.v, base.length
        out.block_keys, out.num_blocks = self.block_keys[: self.num_blocks].clone(), self.num_blocks
        out.pending = self.pending.clone()
        return out


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.budget = cfg.indexer_compress_ratio, cfg.indexer_budget
        self.block_topk = self.budget // self.ratio
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_layernorm = RMSNorm(self.dim, cfg.rms_norm_eps, zero_centered=True)
        self.rotary = Rotary(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta)  # block keys' positions

    def forward(self, x: torch.Tensor, rope, cache: QSACache) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> index queries [T, Hi, Di] and every block key [blocks, Di]; advances the block state."""
        t = x.shape[0]
        q, raw_keys = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        q = apply_rotary(self.q_layernorm(q.view(t, self.heads, self.dim)), *rope)
        pending = torch.cat([cache.pending, raw_keys])
        n = pending.shape[0] // self.ratio
        blocks = cache.block_keys[: cache.num_blocks]
        if n:
            pooled = pending[: n * self.ratio].view(n, self.ratio, self.dim).float().mean(dim=1).to(x.dtype)
            starts = (cache.num_blocks + torch.arange(n, device=x.device)) * self.ratio
            cos, sin = self.rotary.cos_sin(starts, x.dtype)
            blocks = cache.add_blocks(apply_rotary(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0])
        cache.pending = pending[n * self.ratio:].clone()
        return q, blocks

    def select(self, q: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor):
        """q [T, Hi, Di], blocks [B, Di], positions [T] -> token ids [T, S] and their validity [T, S]."""
        complete = (positions + 1) // self.ratio  # blocks each query may choose from (a prefix)
        scores = torch.matmul(q.float(), blocks.float().T).transpose(-1, -2)  # [T, B, Hi]
        scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.dim)  # [T, B]
        k = min(self.block_topk, blocks.shape[0])
        allowed = torch.arange(blocks.shape[0], device=q.device)[None] < complete[:, None]
        top = scores.masked_fill(~allowed, float("-inf")).topk(min(k + 1, blocks.shape[0]), dim=-1)
        chosen, chosen_ok = top.indices[:, :k], top.values[:, :k] > float("-inf")
        if top.values.shape[1] > k:
            tied = (complete > k) & (top.values[:, k - 1] == top.values[:, k])
            for n in torch.unique(complete[tied]).tolist():  # rare: resolve as topk over the prefix does
                rows = torch.nonzero(tied & (complete == n)).flatten()
                chosen[rows] = scores[rows, :n].topk(k, dim=-1).indices
        chosen = torch.where(chosen_ok, chosen, blocks.shape[0]).sort(dim=-1).values  # invalid ones last
        offsets = torch.arange(self.ratio, device=q.device)
        block_tokens = (chosen[:, :, None] * self.ratio + offsets).flatten(1)  # [T, k * ratio]
        tail = complete[:, None] * self.ratio + offsets[: self.ratio - 1]  # [T, ratio - 1]
        ids = torch.cat([block_tokens, tail], dim=1)
        ok = torch.cat([(chosen < blocks.shape[0]).repeat_interleave(self.ratio, dim=1),
                        tail <= positions[:, None]], dim=1)
        return ids.clamp_max(positions.max()), ok


class IndexedAttention(Attention):
    """Gated attention (zero-centred q/k norms) whose queries see only the tokens the indexer selects. Its block
    selection has no static form yet, so a step through it is not captured."""

    graph_safe = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qk_norm=True, output_gate=True, zero_centered=True)
        self.indexer = Indexer(cfg)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> QSACache:
        return QSACache(self.kv_heads, self.head_dim, self.indexer.dim, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: QSACache,
                ctx: StepContext) -> torch.Tensor:
        t, start = x.shape[0], cache.length
        index_q, blocks = self.indexer(x, rope, cache)
        q, k, v, gate = self.project(x, rope)
        keys, values = cache.append(k, v)
        scale = self.head_dim ** -0.5
        if keys.shape[0] < self.indexer.budget + self.indexer.ratio:  # every visible token is selected
            return self.finish(causal_attention(q, keys, values, scale), gate)
        positions = torch.arange(start, start + t, device=x.device)
        per_query = (self.indexer.budget + self.indexer.ratio - 1) * self.kv_heads * self.head_dim
        chunk = max(1, QUERY_CHUNK_ELEMENTS // per_query)
        out = torch.cat([self._sparse(q[i: i + chunk], index_q[i: i + chunk], blocks, positions[i: i + chunk],
                                      keys, values, scale) for i in range(0, t, chunk)])
        return self.finish(out, gate)

    def _sparse(self, q, index_q, blocks, positions, keys, values, scale) -> torch.Tensor:
        """q [T, Hq, D] attends to its selected rows of keys, values [L, Hkv, D] -> [T, Hq, D]."""
        ids, ok = self.indexer.select(index_q, blocks, positions)  # [T, S]
        k, v = keys[ids].transpose(1, 2), values[ids].transpose(1, 2)  # [T, Hkv, S, D]
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=ok[:, None, None], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[:, :, 0]
