"""Dispatch: each op picks its Triton version on CUDA and the torch reference elsewhere.

`MOESTREAM_KERNELS`, read once at import: `reference` forces the reference everywhere (A/B checks of a kernel
against its oracle on the GPU); `triton` forces Triton (the CPU interpreter with TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

import os

import torch

from moestream.experts.format import NgramLayout
from moestream.experts.grouping import AddressedExperts, ExpertBatch, PlacedExperts, RemoteExperts
from moestream.kernels import reference

DECODE_MAX_ROWS = 16  # launches over at most this many token rows use the decode tile config; their rows' bits do
# not depend on how many there are (a verify step's k+1 rows equal k+1 decode steps): the GPU kernels' tiles depend on
# the weights only, and the CPU reference computes such rows one at a time


KERNELS = os.environ.get("MOESTREAM_KERNELS", "")


def use_triton(device: torch.device) -> bool:
    return KERNELS != "reference" and (KERNELS == "triton" or device.type == "cuda")


def expert_phase(rows: int) -> str:
    return "decode" if rows <= DECODE_MAX_ROWS else "prefill"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (reference.rms_norm)."""
    if use_triton(x.device):
        from moestream.kernels import rowwise

        return rowwise.rms_norm(x, weight, eps, zero_centered)
    return reference.rms_norm(x, weight, eps, zero_centered)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) (reference.add_rms_norm), one launch on the GPU."""
    if use_triton(x.device):
        from moestream.kernels import rowwise

        return rowwise.add_rms_norm(x, residual, weight, eps, zero_centered)
    return reference.add_rms_norm(x, residual, weight, eps, zero_centered)


def qk_norm_rope_cache(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm, k_norm, eps: float,
                       zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor, k_cache, v_cache,
                       position: torch.Tensor, maps=None) -> torch.Tensor:
    """Decode tokens' q/k norms, rotary and KV cache writes, in place or through row maps (a paged cache; one for
    every token, or each token its own) (reference.qk_norm_rope_cache)."""
    args = (qkv, heads, kv_heads, head_dim, q_norm, k_norm, eps, zero_centered, cos, sin, k_cache, v_cache, position,
            maps)
    if use_triton(qkv.device):
        from moestream.kernels import rowwise

        return rowwise.qk_norm_rope_cache(*args)
    return reference.qk_norm_rope_cache(*args)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (reference.rotary)."""
    if use_triton(x.device):
        from moestream.kernels import rowwise

        return rowwise.rotary(x, cos, sin)
    return reference.rotary(x, cos, sin)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias (reference.linear); a decode step's few rows on the GPU as a Triton GEMV, which reads at
    the HBM rate where cuBLAS splits K and adds a reduce kernel (21% faster graphed decode on the H200), and whose
    rows' bits do not depend on how many there are."""
    if x.shape[0] <= DECODE_MAX_ROWS and use_triton(x.device):
        from moestream.kernels import dense_gemv

        return dense_gemv.dense_gemv(x, weight, bias)
    if 1 < x.shape[0] <= DECODE_MAX_ROWS:
        return torch.cat([reference.linear(row, weight, bias) for row in x.split(1)])
    return reference.linear(x, weight, bias)


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, experts: int, top_k: int,
                  normalise: bool, ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(x @ weight.T + bias, then `route` of its first `experts` columns): a router's product and its routing, in
    one launch for a decode step's rows on the GPU (the GEMV's last block routes)."""
    if x.shape[0] <= DECODE_MAX_ROWS and use_triton(x.device):
        from moestream.kernels import dense_gemv

        return dense_gemv.dense_gemv(x, weight, bias, route=dense_gemv.Route(experts, top_k, normalise, x.dtype,
                                                                               ids_out))
    y = linear(x, weight, bias)
    return (y, *route(y[:, :experts], top_k, normalise, x.dtype, ids_out))


def glu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up @ weight.T (reference.glu_linear); a decode step's rows on the GPU as one GEMV launch."""
    if gate.shape[0] <= DECODE_MAX_ROWS and use_triton(gate.device):
        from moestream.kernels import dense_gemv

        return dense_gemv.dense_gemv(gate, weight, None, up)
    if 1 < gate.shape[0] <= DECODE_MAX_ROWS:
        return torch.cat([reference.glu_linear(g, u, weight) for g, u in zip(gate.split(1), up.split(1))])
    return reference.glu_linear(gate, up, weight)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k outputs y [T, K, H] weighted in k order, plus the gated shared expert (reference.moe_combine)."""
    if use_triton(y.device):
        from moestream.kernels import combine

        return combine.moe_combine(y, weights, shared, shared_gate)
    return reference.moe_combine(y, weights, shared, shared_gate)


def combine_add_rms_norm(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                         shared_gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x, moe_combine(y, weights, shared, shared_gate), ...): an MoE block's output added to the
    residual stream and normed for the next block, one launch on the GPU."""
    if use_triton(x.device):
        from moestream.kernels import combine

        return combine.combine_add_rms_norm(x, y, weights, shared, shared_gate, weight, eps, zero_centered)
    return reference.add_rms_norm(x, reference.moe_combine(y, weights, shared, shared_gate), weight, eps,
                                  zero_centered)


def decode_attention(q: torch.Tensor, k_cache, v_cache, position: torch.Tensor, scale: float,
                     rows: torch.Tensor | None = None, gate: torch.Tensor | None = None, maps=None) -> torch.Tensor:
    """Query tokens, each over its positions 0..position, or one over the listed positions `rows`, in a cache
    stored in place or paged (row maps: one for every token, or each token its own), optionally gated
    (reference.decode_attention); no host sync on Triton."""
    if use_triton(q.device):
        from moestream.kernels import decode_attention as kernel

        return kernel.decode_attention(q, k_cache, v_cache, position, scale, rows, gate, maps)
    return reference.decode_attention(q, k_cache, v_cache, position, scale, rows, gate, maps)


def qsa_block_key(index_keys: torch.Tensor, block_keys: torch.Tensor, raw_key: torch.Tensor, position: torch.Tensor,
                  ratio: int, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> None:
    """A decode token's indexer key, and its block's key when it completes one (reference.qsa_block_key)."""
    args = (index_keys, block_keys, raw_key, position, ratio, norm_weight, eps, inv_freq)
    if use_triton(raw_key.device):
        from moestream.kernels import qsa

        return qsa.block_key(*args)
    return reference.qsa_block_key(*args)


def qsa_scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """One token's index queries q [1, Hi, Di] against block keys [B, Di] -> [B] (reference.qsa_scores)."""
    if use_triton(q.device):
        from moestream.kernels import qsa

        return qsa.scores(q, blocks)
    return reference.qsa_scores(q, blocks)[0]


def qsa_rows(scores: torch.Tensor, position: torch.Tensor, ratio: int, block_topk: int) -> torch.Tensor:
    """The cache rows one query at `position` attends to, -1 for none (reference.qsa_rows); no sort on Triton."""
    if use_triton(scores.device):
        from moestream.kernels import qsa

        return qsa.rows(scores, position, ratio, block_topk)
    return reference.qsa_rows(scores, position, ratio, block_topk)


def route(logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype,
          ids_out: torch.Tensor | None = None):
    """Softmax top-k routing (reference.route); the ids land in `ids_out` when given."""
    if use_triton(logits.device):
        from moestream.kernels import rowwise

        return rowwise.route(logits, top_k, normalise, dtype, ids_out)
    weights, ids = reference.route(logits, top_k, normalise, dtype)
    if ids_out is None:
        return weights, ids
    return weights, ids_out.view(ids.shape).copy_(ids)


def ngram_rows(table: torch.Tensor, ids: torch.Tensor, layout: NgramLayout, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an n-gram table (uint8 [rows, row_bytes], device or pinned host memory), decoded to `dtype`
    (reference.ngram_rows); the Triton version reads the table in place with no host sync."""
    if use_triton(ids.device):
        from moestream.kernels import ngram_rows as kernel

        return kernel.ngram_rows(table, ids, layout, dtype)
    return reference.ngram_rows(table, ids, layout, dtype)


def ngram_ids(ids: torch.Tensor, context: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor,
              offsets: torch.Tensor, heads_per_ngram: int, eos: int) -> torch.Tensor:
    """PLE's hashed n-gram row ids [T, heads] of ids [T] after `context` (reference.ngram_ids); the Triton version
    is one launch (the torch ops are ~45 a PLE layer)."""
    if use_triton(ids.device):
        from moestream.kernels import ngram_rows as kernel

        return kernel.ngram_ids(ids, context, multipliers, sizes, offsets, heads_per_ngram, eos)
    return reference.ngram_ids(ids, context, multipliers, sizes, offsets, heads_per_ngram, eos)


def deltanet_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str,
                  conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A DeltaNet layer between its projections, states updated in place (reference.deltanet_step); one
    token's is two or three Triton launches (conv, recurrence with the gated norm), a prompt's fla's chunked kernels."""
    args = (mixed, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, activation, conv_state, state)
    if use_triton(mixed.device):
        from moestream.kernels import deltanet

        return (deltanet.deltanet_step if mixed.shape[0] == 1 else deltanet.deltanet_prefill)(*args)
    return reference.deltanet_step(*args)


def expert_part(x: torch.Tensor, part: ExpertBatch | AddressedExperts | PlacedExperts | RemoteExperts, top_k: int,
                out: torch.Tensor) -> None:
    """Unweighted outputs of the routing entries a provider part covers, into `out` [T * top_k, H] (entry
    e = row * top_k + k): a batch's experts over their entries order[a:b] (`spans`), records in buffer slots;
    every entry with its record at `table[ids[e]]` (a layer's device addresses by expert id; CUDA only), or grouped
    on the device when they are its every record (PlacedExperts; CUDA only); or the entries other ranks computed,
    joined into `out`."""
    if isinstance(part, RemoteExperts):
        part.join(out)
    elif isinstance(part, AddressedExperts):
        from moestream.kernels import expert_mlp

        expert_mlp.per_entry(x, part, top_k, out)
    elif isinstance(part, PlacedExperts):
        from moestream.kernels import expert_mlp

        expert_mlp.placed(x, part, top_k, out, expert_phase(x.shape[0]))
    elif use_triton(x.device):
        from moestream.kernels import expert_mlp

        expert_mlp.grouped(x, part.buffer, part.slots, part.layout, part.spans, part.order, top_k, out,
                           expert_phase(x.shape[0]))
    else:
        reference.expert_group(x, part.buffer, part.slots, part.layout, part.spans, part.order, top_k, out,
                               by_entry=x.shape[0] <= DECODE_MAX_ROWS)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                     group_size: int) -> torch.Tensor:
    """RMSNorm of each `group_size` slice with its own weight slice (reference.grouped_rms_norm), one launch on
    the GPU."""
    if use_triton(x.device):
        from moestream.kernels import rowwise

        return rowwise.grouped_rms_norm(x, weight, eps, zero_centered, group_size)
    return reference.grouped_rms_norm(x, weight, eps, zero_centered, group_size)


def inject_rms_norm(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(streams + a block's output injected at per-stream weights, its grouped norm) (reference.inject_rms_norm),
    one launch on the GPU."""
    if use_triton(streams.device):
        from moestream.kernels import hyper

        return hyper.inject_rms_norm(streams, out, weights, norm_weight, eps, zero_centered)
    return reference.inject_rms_norm(streams, out, weights, norm_weight, eps, zero_centered)


def hyper_mix(normed: torch.Tensor, projected: torch.Tensor, up_weight: torch.Tensor,
              streams: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A hyper-connection's block input and injection weights from its normed streams and their projection
    (reference.hyper_mix); one token's on the GPU is one launch that reads the up weight once, a few tokens' one
    launch each."""
    if 1 < normed.shape[0] <= DECODE_MAX_ROWS:
        rows = zip(normed.split(1), projected.split(1))
        mixed, weights = zip(*(hyper_mix(n, p, up_weight, streams) for n, p in rows))
        return torch.cat(mixed), None if weights[0] is None else torch.cat(weights)
    if normed.shape[0] == 1 and use_triton(normed.device):
        from moestream.kernels import hyper

        return hyper.hyper_mix(normed, projected, up_weight, streams)
    return reference.hyper_mix(normed, projected, up_weight, streams)
