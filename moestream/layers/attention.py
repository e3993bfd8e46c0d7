"""Softmax attention with a KV cache: GQA, optional q/k RMSNorm, qkv bias, and the sigmoid output gate
of the hybrid models (their q_proj emits a query and a gate per head)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moestream.config import ModelConfig
from moestream.kernels import ops
from moestream.layers.context import StepContext
from moestream.layers.kv import KVCache
from moestream.layers.linear import Linear, Projections
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import apply_rotary
from moestream.layers.rows import Batched

# cuDNN's SDPA (which torch picks on Hopper for some lengths, e.g. multiples of 128) builds and compiles its graph
# the first time a process uses it: ~0.7 s on the H200's first 512-token prompt. Flash attention (memory-efficient
# with a mask) has no first-use cost, and prompts of every length then run the same kernel.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (the last T of L positions); k, v [L, Hkv, D] -> [T, Hq, D]."""
    t, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    mask = None
    if 1 < t < length:  # a chunk after cached positions: the causal diagonal is offset
        mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
        # with a mask, GQA may send SDPA to its math kernel (scores materialized): expand the KV heads instead
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # a whole prompt is plain causal attention, which SDPA runs as flash attention, GQA included
    with sdpa_kernel(PREFILL_BACKENDS) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, is_causal=1 < t == length,
                                             scale=scale, enable_gqa=mask is None and groups > 1)
    return out[0].transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, output_gate: bool, zero_centered: bool):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.output_gate = output_gate
        self.q_proj = Linear(h, self.heads * d * (2 if output_gate else 1), bias=cfg.qkv_bias)
        self.k_proj = Linear(h, self.kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, self.kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.heads * d, h, bias=cfg.o_bias)
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)  # [q (with its gate halves) | k | v]
        if qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centered)
        self.qk_norm = qk_norm

    def new_state(self, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(self.kv_heads, self.head_dim, dtype, device)

    def fuse_projections(self) -> None:
        self.qkv.fuse()

    def gate_heads(self, qkv: torch.Tensor) -> torch.Tensor | None:
        """The output gate [T, Hq, D] (a view: the second half of each q head's slice), or None."""
        if not self.output_gate:
            return None
        return qkv[:, : self.q_proj.out_features].view(qkv.shape[0], self.heads, -1)[..., self.head_dim:]

    def gate_of(self, qkv: torch.Tensor) -> torch.Tensor | None:
        """The output gate [T, Hq*D], or None."""
        gate = self.gate_heads(qkv)
        return None if gate is None else gate.reshape(qkv.shape[0], -1)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [T, H] -> q [T, Hq, D], k, v [T, Hkv, D], gate [T, Hq*D] or None."""
        t, qkv = x.shape[0], self.qkv(x)
        q, k, v = qkv.split(self.qkv.sizes, -1)
        q = q.reshape(t, self.heads, -1)[..., : self.head_dim]
        gate = self.gate_of(qkv)
        k = k.reshape(t, self.kv_heads, self.head_dim)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate

    def finish(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                ctx: StepContext) -> torch.Tensor:
        if ctx.static:
            return self._static(x, rope, ctx.positions, cache)
        end = cache.length + x.shape[0]
        cache.make_room(end)
        qkv = self.qkv(x)  # norms, rotary and the cache rows in one launch, as a decode step writes them
        q = ops.qk_norm_rope_cache(qkv, self.heads, self.kv_heads, self.head_dim, *self._norms(), *rope, cache.k,
                                   cache.v, ctx.positions, cache.row_map)
        return self.finish(causal_attention(q, *cache.keys_values(end), self.head_dim ** -0.5), self.gate_of(qkv))

    def _norms(self) -> tuple:
        """qk_norm_rope_cache's (q norm, k norm, eps, zero-centred) arguments."""
        if not self.qk_norm:
            return None, None, 0.0, False
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.zero_centered

    def _static(self, x: torch.Tensor, rope, positions: torch.Tensor, cache) -> torch.Tensor:
        """Tokens at device-side `positions` [T] over the reserved cache's positions 0..position, so the shapes never
        change and the step can be captured in a CUDA graph; several rows (a verify step's over one cache, whose
        rows are all written before any attends; a batched step's, each over its own sequence's cache) in one
        launch each, every row as a decode step computes it."""
        t, qkv = x.shape[0], self.qkv(x)
        one, maps = cache, cache.row_map
        if isinstance(cache, Batched):  # the slots' caches share their pool's store; each row has its own map
            one, maps = cache[0], list(maps)
            assert all(c.store is one.store for c in cache)
        q = ops.qk_norm_rope_cache(qkv, self.heads, self.kv_heads, self.head_dim, *self._norms(), *rope, one.k,
                                   one.v, positions, maps)
        out = ops.decode_attention(q, one.k, one.v, positions, self.head_dim ** -0.5, gate=self.gate_heads(qkv),
                                   maps=maps)
        return self.o_proj(out.reshape(t, -1))
