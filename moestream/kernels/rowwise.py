"""Launching the row-wise Triton kernels: RMSNorm, the rotary embedding, the tokens' attention glue and MoE
routing."""

from __future__ import annotations

import torch
import triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps, zero_centered)[1]


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                     group_size: int) -> torch.Tensor:
    """reference.grouped_rms_norm in one launch: a program per `group_size` slice of x."""
    return _rms_norm(x, None, weight, eps, zero_centered, group_size)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) from one launch."""
    return _rms_norm(x, residual.contiguous(), weight, eps, zero_centered)


def _rms_norm(x, residual, weight, eps, zero_centered, group_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    from moestream.kernels.triton.rowwise import rms_norm_kernel

    d = group_size or x.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    total = x if residual is None else torch.empty_like(x)
    rms_norm_kernel[(x.numel() // d,)](x, x if residual is None else residual, total, weight, out, eps, D=d,
                                      BLOCK=triton.next_power_of_2(d), ZERO_CENTERED=zero_centered,
                                      ADD=residual is not None, GROUPS=weight.numel() // d,
                                      num_warps=4 if d >= 1024 else 1)
    return total, out


# tokens a glue program takes: one-warp programs of one token were latency-bound at 4096 (a chain of dependent loads
# each, ~4x the copy time). The same tile at every T, so a token's bits do not depend on its batch.
GLUE_ROWS = 8


def qk_norm_rope_cache(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, eps: float, zero_centered: bool, cos: torch.Tensor,
                       sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                       maps: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor:
    """reference.qk_norm_rope_cache in one launch: T tokens, into one cache, in place or through row maps."""
    from moestream.kernels.decode_attention import map_args
    from moestream.kernels.triton.rowwise import qk_norm_rope_cache_kernel

    t = qkv.shape[0]
    row_map, offsets, mapped, per_token = map_args(maps, position)
    q_width = qkv.shape[-1] - 2 * kv_heads * head_dim
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    qkv = qkv.contiguous()
    qk_norm_rope_cache_kernel[(heads + 2 * kv_heads, triton.cdiv(t, GLUE_ROWS))](
        qkv, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, cos.contiguous(),
        sin.contiguous(), q, k_cache, v_cache, position, row_map, offsets, eps, t, qkv.shape[-1], HEADS=heads,
        KV_HEADS=kv_heads, D=head_dim, Q_STRIDE=q_width // heads, ROT=cos.shape[-1],
        BLOCK=triton.next_power_of_2(head_dim), ROWS=GLUE_ROWS, QK_NORM=q_norm is not None,
        ZERO_CENTERED=zero_centered, MAP=mapped, OFFSETS=per_token, num_warps=GLUE_ROWS // 2)
    return q


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim] in x's dtype."""
    from moestream.kernels.triton.rowwise import rotary_kernel

    t, heads, d = x.shape
    rot = cos.shape[-1]
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotary_kernel[(t, heads)](x, cos.contiguous(), sin.contiguous(), out, HEADS=heads, D=d, ROT=rot,
                              HALF_BLOCK=triton.next_power_of_2(rot // 2),
                              REST_BLOCK=triton.next_power_of_2(max(d - rot, 1)), num_warps=1)
    return out


def route(logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype,
          ids_out: torch.Tensor | None = None):
    """logits [T, E] -> (weights [T, top_k] in `dtype`, expert ids [T, top_k] int64, in `ids_out` if given)."""
    from moestream.kernels.triton.rowwise import route_kernel

    t, experts = logits.shape
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device) if ids_out is None else ids_out.view(t, top_k)
    route_kernel[(t,)](logits.contiguous(), weights, ids, E=experts, BLOCK=triton.next_power_of_2(experts),
                       TOP_K=top_k, K_BLOCK=triton.next_power_of_2(top_k), NORMALISE=normalise,
                       num_warps=4 if experts >= 256 else 1)
    return weights, ids
