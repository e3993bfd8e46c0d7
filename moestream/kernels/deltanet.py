"""Launching one decode token's Gated DeltaNet kernels (triton/deltanet.py): the conv step, then the recurrent
step, which applies the gated norm itself when one program holds a head's whole state (Dk * Dv up to
FUSED_TILE: two launches at the flagship's 128 x 128), else in a third launch. No host sync, states updated in
place, outputs of fixed shapes: the same launches at every step (CUDA-graph safe).

A prompt's rows go through flash-linear-attention's chunked gated delta rule (fla-core: Triton, tensor cores)
instead, the well-kept kernel transformers itself calls for Qwen3-Next when it is installed."""

from __future__ import annotations

import torch
import triton

FUSED_TILE = 128 * 128  # fp32 state elements of one program: 164 registers a thread at 8 warps on sm_90, no spills
SPLIT_TILE = 64 * 64  # elements of one program when a head's columns are split
CONV_BLOCK = 256  # channels a program (40 programs at conv_dim 10240)
PREFILL_CONV_TILE = (32, 128)  # rows x channels a program of a prompt's conv


def recurrent_tiles(dk: int, dv: int, norm: bool) -> tuple[int, int, bool, int]:
    """(BK, BV, whether the norm is fused, warps) of the recurrent step: a whole head a program when its state
    fits FUSED_TILE and the norm is wanted, else column blocks of SPLIT_TILE; about 64 elements a thread."""
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    fused = norm and bk * bv <= FUSED_TILE
    if not fused:
        bv = min(bv, max(1, SPLIT_TILE // bk))
    return bk, bv, fused, max(1, min(8, bk * bv // 2048))


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d of one row x [1, C] against state [K-1, C] (contiguous; shifted in place: the
    oldest row dropped, x appended), weight [C, 1, K] -> silu(conv) [1, C] in x's dtype."""
    from moestream.kernels.triton.deltanet import conv_step_kernel

    c, k = weight.shape[0], weight.shape[-1]
    assert k >= 2 and x.shape == (1, c) and state.shape == (k - 1, c) and state.is_contiguous()
    out = torch.empty(1, c, dtype=x.dtype, device=x.device)
    block = min(CONV_BLOCK, triton.next_power_of_2(c))
    conv_step_kernel[(triton.cdiv(c, block),)](x.contiguous(), state, weight.contiguous(), out, C=c, K=k,
                                               ROWS=triton.next_power_of_2(k - 1), BLOCK=block,
                                               num_warps=2 if block >= 128 else 1)
    return out


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, ...]:
    """reference.causal_conv1d of T rows x [T, C] (rows of any stride) after state [K-1, C] (contiguous, then
    shifted in place to end with x's last rows), weight [C, 1, K] -> (q [T, key_dim], k [T, key_dim], v), each
    contiguous, in x's dtype."""
    from moestream.kernels.triton.deltanet import conv_prefill_kernel

    t, c = x.shape
    k = weight.shape[-1]
    assert k >= 2 and state.shape == (k - 1, c) and state.is_contiguous() and x.stride(1) == 1
    out = torch.empty(t * c, dtype=x.dtype, device=x.device)
    bt, bc = PREFILL_CONV_TILE
    conv_prefill_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](x, state, weight.contiguous(), out, t, x.stride(0),
                                                                  C=c, KEY=key_dim, K=k, BT=bt, BC=bc, num_warps=4)
    state.copy_(torch.cat([state, x[-(k - 1):]])[-(k - 1):])  # after the kernel read it (stream order)
    q, kk, v = out.split([t * key_dim, t * key_dim, t * (c - 2 * key_dim)])
    return q.view(t, key_dim), kk.view(t, key_dim), v.view(t, c - 2 * key_dim)


def recurrent_step(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, state: torch.Tensor, z: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0, activation: str = "silu") -> torch.Tensor:
    """One token of reference.deltanet_recurrent: mixed [1, 2 * Nk * Dk + Hv * Dv] (the conv output), b, a [1, Hv],
    state [Hv, Dk, Dv] fp32 contiguous, updated in place. Returns [1, Hv, Dv] in mixed's dtype: the output
    rounded, or with z [1, Hv, Dv] its reference.gated_rms_norm (norm_weight [Dv], eps, activation)."""
    from moestream.kernels.triton.deltanet import recurrent_step_kernel

    hv, dk, dv = state.shape
    nk = (mixed.shape[-1] - hv * dv) // (2 * dk)
    assert mixed.shape == (1, 2 * nk * dk + hv * dv) and hv % nk == 0
    assert state.dtype == torch.float32 and state.is_contiguous()
    bk, bv, fused, warps = recurrent_tiles(dk, dv, z is not None)
    out = torch.empty(1, hv, dv, dtype=mixed.dtype, device=mixed.device)
    zc = out if z is None else z.contiguous()
    recurrent_step_kernel[(hv, triton.cdiv(dv, bv))](
        mixed.contiguous(), b.contiguous(), a.contiguous(), A_log, dt_bias, state, zc,
        out if norm_weight is None else norm_weight, out, dk ** -0.5, eps, NK=nk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv,
        NORM=fused, SILU=activation == "silu", num_warps=warps)
    if z is None or fused:
        return out
    return gated_rms_norm(out, zc, norm_weight, eps, activation)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str) -> torch.Tensor:
    """reference.gated_rms_norm over the last dim D of x, gate [..., D] (weight [D] in x's dtype), one program a
    row. Returns x's shape and dtype."""
    from moestream.kernels.triton.deltanet import gated_norm_kernel

    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    gated_norm_kernel[(x.numel() // d,)](x.contiguous(), gate.contiguous(), weight, out, eps, D=d, BLOCK=block,
                                         SILU=activation == "silu", num_warps=4 if block >= 1024 else 1)
    return out


def deltanet_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str,
                  conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """reference.deltanet_step for one token (mixed [1, C]): conv_state and state updated in place. Returns
    [1, Hv * Dv] in mixed's dtype."""
    conv = conv_step(mixed, conv_state, conv_weight)
    return recurrent_step(conv, b, a, A_log, dt_bias, state, z, norm_weight, eps, activation).view(1, -1)


def deltanet_prefill(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     activation: str, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """reference.deltanet_step over T > 1 tokens: the causal conv (conv_prefill), then the delta rule in fla's
    chunked kernels (value head h reads key head h // (Hv // Nk), as fla's grouped value heads do). States updated
    in place. Returns [T, Hv * Dv] in mixed's dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t = mixed.shape[0]
    hv, dk, dv = state.shape
    nk = (mixed.shape[-1] - hv * dv) // (2 * dk)
    q, k, v = conv_prefill(mixed, conv_state, conv_weight, nk * dk)
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    out, final = chunk_gated_delta_rule(q.reshape(1, t, nk, dk), k.reshape(1, t, nk, dk), v.reshape(1, t, hv, dv),
                                        g[None], beta[None], initial_state=state[None], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return gated_rms_norm(out[0].to(mixed.dtype), z.reshape(t, hv, dv), norm_weight, eps, activation).view(t, -1)
