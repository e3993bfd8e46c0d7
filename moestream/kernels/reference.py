"""Pure-torch reference of every kernel op: the CPU path and the oracle for the Triton versions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.experts.format import NgramLayout, RecordLayout
from moestream.quant.affine import dequantize, unpack_codes
from moestream.quant.lowbit import dequantize_lowbit


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim: `w * norm(x)` with norm(x) rounded to x's dtype first, or `(1 + w) * norm(x)`
    in fp32; `weight` broadcasts against x."""
    normed = rms(x, eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm): the residual stream and the next block's input."""
    total = x + residual
    return total, rms_norm(total, weight, eps, zero_centered)


def qk_norm_rope_cache(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, eps: float, zero_centered: bool, cos: torch.Tensor,
                       sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                       maps=None) -> torch.Tensor:
    """Decode tokens' [q | k | v] projection rows qkv [T, width] (q heads may carry a gate half after their query)
    -> q [T, heads, head_dim], RMS-normed (q_norm, k_norm weights, or none) and rotated; token t's k, normed and
    rotated, and v are written to the caches [rows, kv_heads, head_dim] at its position's row: position[t], or
    maps[t][position[t]] through row maps (a paged cache: one [C] for all tokens, or a list of T). A token at a time,
    as one decode step computes it."""
    at = stored_rows(maps, position)
    kv = kv_heads * head_dim
    out = []
    for t in range(qkv.shape[0]):
        row = qkv[t: t + 1]
        q = row[:, : row.shape[-1] - 2 * kv].view(1, heads, -1)[..., :head_dim]
        k, v = (part.view(1, kv_heads, head_dim) for part in row[:, row.shape[-1] - 2 * kv:].split(kv, dim=-1))
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps, zero_centered), rms_norm(k, k_norm, eps, zero_centered)
        rot = cos[t: t + 1], sin[t: t + 1]
        q, k = rotary(q, *rot), rotary(k, *rot)
        k_cache.index_copy_(0, at[t: t + 1], k)
        v_cache.index_copy_(0, at[t: t + 1], v)
        out.append(q)
    return torch.cat(out)


def stored_rows(maps, positions: torch.Tensor) -> torch.Tensor:
    """The cache rows of token t's position positions[t] [T]: itself, or through row maps (one for all tokens, or a
    list of T)."""
    if maps is None:
        return positions
    if isinstance(maps, list):
        return torch.stack([m[p] for m, p in zip(maps, positions)])
    return maps[positions]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of the first cos.shape[-1] dims. x [T, heads, head_dim]; cos, sin [T, rot]."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def route(logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype):
    """Router logits [T, E] -> (weights [T, K] in `dtype`, expert ids [T, K]); softmax in fp32."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(dtype), ids


def expert_weights(record: torch.Tensor, layout: RecordLayout, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One record's bytes -> (gate [I, H], up [I, H], down [H, I]) in `dtype`."""
    v = layout.views(record)
    if layout.bits == 16:
        return tuple(v[f"{p}_w"].to(dtype) for p in ("gate", "up", "down"))
    if layout.bits < 4:
        return tuple(dequantize_lowbit([v[f"{p}_w"]] + ([v[f"{p}_h"]] if layout.bits == 3 else []), v[f"{p}_s"],
                                       v[f"{p}_b"], layout.bits, layout.group_size).to(dtype)
                     for p in ("gate", "up", "down"))
    return tuple(dequantize(v[f"{p}_w"], v[f"{p}_s"], v[f"{p}_b"], layout.bits, layout.group_size).to(dtype)
                 for p in ("gate", "up", "down"))


def expert_group(x: torch.Tensor, buffer: torch.Tensor, slots: list[int], layout: RecordLayout,
                 spans: list[tuple[int, int]], order: torch.Tensor, top_k: int, out: torch.Tensor,
                 by_entry: bool = False) -> None:
    """Experts `slots[j]` (records in `buffer`) over their rows; writes each (row, k) output once.

    x [T, H]; order [M] flat (row * top_k + k) indices grouped by expert, expert j owning
    order[spans[j][0]:spans[j][1]]; out [T * top_k, H] receives the unweighted expert outputs. `by_entry`: one
    entry at a time, so that a row's bits do not depend on the rows sharing its expert.
    """
    for (a, b), slot in zip(spans, slots):
        gate, up, down = expert_weights(buffer[slot], layout, x.dtype)
        for flat in order[a:b].split(1) if by_entry else (order[a:b],):
            rows = x[flat // top_k]
            out[flat] = (F.silu(rows @ gate.T) * (rows @ up.T)) @ down.T


def shift_within_segments(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history [L] ids -> [L]: the id `shift` places back, or EOS where that crosses an EOS or the start."""
    if shift == 0:
        return history
    positions = torch.arange(history.shape[0], device=history.device)
    eos_at = torch.where(history == eos, positions, -1)
    last_eos_before = F.pad(torch.cummax(eos_at, dim=0).values[:-1], (1, 0), value=-1)
    # valid when no EOS lies in [p - shift, p - 1] and p - shift >= 0
    valid = (positions - (last_eos_before + 1) >= shift) & (positions >= shift)
    shifted = history[(positions - shift).clamp_min(0)]
    return torch.where(valid, shifted, torch.full_like(history, eos))


def ngram_ids(ids: torch.Tensor, context: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor,
              offsets: torch.Tensor, heads_per_ngram: int, eos: int) -> torch.Tensor:
    """PLE's hashed n-gram rows: ids [T] after context [n - 1] (n = len(multipliers)) -> table row ids [T, heads],
    ordered by n-gram order (2..n), then head; the order-m hash XORs ids[t - j] * multipliers[j] for j < m (int64
    products wrap), with EOS for a place back across an EOS or the start; row = hash mod size + offset per head."""
    history = torch.cat([context, ids])
    shifted = [shift_within_segments(history, s, eos) for s in range(multipliers.shape[0])]
    blocks = []
    for order in range(2, multipliers.shape[0] + 1):
        mixed = shifted[0] * multipliers[0]
        for position in range(1, order):
            mixed = torch.bitwise_xor(mixed, shifted[position] * multipliers[position])
        heads = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], sizes[heads][None]) + offsets[heads][None])
    return torch.cat(blocks, dim=-1)[context.shape[0]:]


def ngram_decode(raw: torch.Tensor, layout: NgramLayout) -> torch.Tensor:
    """Rows of an n-gram table, raw [n, row_bytes] uint8 -> float32 [n, dim]: bf16 values, or MLX q4 `w | s | b`
    (codes low nibble first, then a bf16 scale and bias per group, `value = scale * code + bias`)."""
    dim = layout.dim
    if layout.precision == "bf16":
        return raw[:, : 2 * dim].contiguous().view(torch.bfloat16).float()
    groups = dim // layout.group_size
    words = raw[:, : dim // 2].contiguous().view(torch.int32)
    scales = raw[:, dim // 2: dim // 2 + 2 * groups].contiguous().view(torch.bfloat16).float()
    biases = raw[:, dim // 2 + 2 * groups: dim // 2 + 4 * groups].contiguous().view(torch.bfloat16).float()
    codes = unpack_codes(words, 4).float().view(-1, groups, layout.group_size)
    return (codes * scales[..., None] + biases[..., None]).view(-1, dim)


def ngram_rows(table: torch.Tensor, ids: torch.Tensor, layout: NgramLayout, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [...] (int64) of an n-gram table (uint8 [rows, row_bytes], on the host or the device), decoded
    -> [..., dim] in `dtype` on ids' device."""
    raw = table[ids.reshape(-1).to(table.device)]
    rows = ngram_decode(raw, layout).to(ids.device, dtype)
    return rows.view(*ids.shape, layout.dim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                shared_gate: torch.Tensor | None) -> torch.Tensor:
    """y [T, K, H] unweighted expert outputs, weights [T, K] -> [T, H]: one batched product, so the sum
    over k runs in the same order whatever was resident; plus sigmoid(shared_gate [T, 1]) * shared [T, H]."""
    out = torch.bmm(weights.unsqueeze(1), y).squeeze(1)
    return out if shared is None else out + torch.sigmoid(shared_gate) * shared


def glu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's down projection from its gate and up products [T, I]: silu(gate) * up @ weight.T."""
    return F.linear(F.silu(gate) * up, weight)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [T, C], state [K-1, C] (previous inputs), weight [C, 1, K].

    Returns (out [T, C], new state [K-1, C])."""
    full = torch.cat([state.to(x.dtype), x], dim=0)
    out = F.conv1d(full.T[None], weight.to(x.dtype), groups=x.shape[1])[0].T
    return F.silu(out), full[full.shape[0] - state.shape[0]:]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over T tokens. q, k [T, Hv, Dk] (before l2norm), v [T, Hv, Dv], g and beta [T, Hv],
    state [Hv, Dk, Dv] fp32. Returns (out [T, Hv, Dv] fp32, final state).

    Per token: S = exp(g) S; S += k (beta (v - k^T S))^T; o = q^T S. Chunks of `chunk` tokens solve the
    within-chunk updates as one triangular system (the UT transform), so the loop runs per chunk.
    """
    dk = q.shape[-1]
    q = _l2norm(q.float()) * dk ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    if q.shape[0] == 1:
        return _delta_step(q[0], k[0], v[0], g[0], beta[0], state)
    t = q.shape[0]
    pad = (-t) % chunk
    q, k, v = (F.pad(a, (0, 0, 0, 0, 0, pad)) for a in (q, k, v))
    g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk
    # [heads, chunks, C, ...]
    q, k, v = (a.view(n, chunk, *a.shape[1:]).permute(2, 0, 1, 3) for a in (q, k, v))
    g, beta = (a.view(n, chunk, -1).permute(2, 0, 1) for a in (g, beta))
    cum = g.cumsum(-1)  # log decay from the chunk start, inclusive
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # Strictly lower part of (beta k k^T * decay); `unitriangular` ignores the diagonal.
    system = (kb @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], dim=-1)
    solve = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solve.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()
    s = state.float()
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, -1, v.shape[-1])[:t]
    return out, s


def _delta_step(q, k, v, g, beta, state):
    """One token: q, k [Hv, Dk], v [Hv, Dv], g, beta [Hv]."""
    s = state.float() * g.exp()[:, None, None]
    delta = (v - (k[:, :, None] * s).sum(1)) * beta[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    return (q[:, :, None] * s).sum(1)[None], s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str) -> torch.Tensor:
    """The DeltaNet output norm over the last dim: `w * norm(x)` (norm rounded to x's dtype first) times
    act(gate) in fp32, act "silu" or "sigmoid", rounded to x's dtype. x, gate [..., D]; weight [D]."""
    act = F.silu if activation == "silu" else torch.sigmoid
    y = weight * rms(x, eps).to(x.dtype)
    return (y * act(gate.float())).to(x.dtype)


def deltanet_recurrent(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule of a DeltaNet layer from its conv output mixed [T, 2 * Nk * Dk + Hv * Dv] = [q|k|v]
    and raw gates b, a [T, Hv]: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); value head h reads
    key head h // (Hv // Nk). state [Hv, Dk, Dv] fp32 is updated in place. Returns out [T, Hv, Dv] fp32."""
    t = mixed.shape[0]
    hv, dk, dv = state.shape
    nk = (mixed.shape[-1] - hv * dv) // (2 * dk)
    q, k, v = mixed.split([nk * dk, nk * dk, hv * dv], dim=-1)
    per = hv // nk  # each key head serves `per` consecutive value heads
    q = q.reshape(t, nk, dk).repeat_interleave(per, dim=1)
    k = k.reshape(t, nk, dk).repeat_interleave(per, dim=1)
    v = v.reshape(t, hv, dv)
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    state.copy_(final)
    return out


def deltanet_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str,
                  conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A DeltaNet layer between its projections, over T tokens: causal conv + SiLU of mixed [T, C], the gated
    delta rule (deltanet_recurrent), the gated norm with z [T, Hv, Dv]. conv_state [K-1, C] and state
    [Hv, Dk, Dv] are updated in place. Returns [T, Hv * Dv] in mixed's dtype."""
    t = mixed.shape[0]
    mixed, conv = causal_conv1d(mixed, conv_state, conv_weight)
    conv_state.copy_(conv)
    out = deltanet_recurrent(mixed, b, a, A_log, dt_bias, state)
    return gated_rms_norm(out.to(mixed.dtype), z, norm_weight, eps, activation).reshape(t, -1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     scale: float, rows: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                     maps=None) -> torch.Tensor:
    """Query tokens q [T, Hq, D], token t over its positions 0..position[t] in the cache k_cache, v_cache
    [N, Hkv, D], or (T = 1) over the positions `rows` [S] where they are >= 0 (QSA's selection). Position p is row
    p, or through row maps (a paged cache: one [C] for all tokens, or a list of T) row maps[t][p]. Query head h
    reads kv head h // (Hq // Hkv). Returns [T, Hq, D], times sigmoid(gate [T, Hq, D]) where given (the gated
    attention's output gate)."""
    t = q.shape[0]
    row_maps = maps if isinstance(maps, list) else [maps] * t
    out = []
    for i in range(t):
        at = torch.arange(int(position[i]) + 1, device=q.device) if rows is None else rows.clamp_min(0)
        at = at if row_maps[i] is None else row_maps[i][at]
        k, v, mask = k_cache[at], v_cache[at], None if rows is None else (rows >= 0)[None, None]
        one = F.scaled_dot_product_attention(q[i: i + 1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        out.append(one[0].transpose(0, 1))
    out = torch.cat(out)
    return out if gate is None else out * torch.sigmoid(gate.reshape(out.shape))


def qsa_rows(scores: torch.Tensor, position: torch.Tensor, ratio: int, block_topk: int) -> torch.Tensor:
    """QSA's choice for one query at `position` [1] from the scores [B] (>= 0) of every block row the cache can
    hold: the `block_topk` best complete blocks (an exact tie to the lower index), in block order, then the tail
    of its incomplete block. Returns the cache rows [block_topk * ratio + ratio - 1] int64, -1 where none."""
    blocks = scores.shape[0]
    complete = (position + 1) // ratio
    index = torch.arange(blocks, device=scores.device)
    allowed = index < complete
    # non-negative float32 scores order as their bits, so (bits, -index) is one exact int64 key
    key = ((scores.view(torch.int32).long() << 31) | ((1 << 31) - 1 - index)).masked_fill(~allowed, -1)
    k = min(block_topk, blocks)
    chosen = key.topk(k).indices
    chosen = torch.where(allowed[chosen], chosen, blocks).sort().values  # invalid ones last
    offsets = torch.arange(ratio, device=scores.device)
    block_rows = torch.where(chosen[:, None] < blocks, chosen[:, None] * ratio + offsets, -1).flatten()
    block_rows = F.pad(block_rows, (0, (block_topk - k) * ratio), value=-1)  # a fixed length, whatever the cache
    tail = complete * ratio + offsets[: ratio - 1]
    return torch.cat([block_rows, torch.where(tail <= position, tail, -1)])


def qsa_block_key(index_keys: torch.Tensor, block_keys: torch.Tensor, raw_key: torch.Tensor, position: torch.Tensor,
                  ratio: int, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> None:
    """A decode token's indexer key: raw_key [1, Di] stored at index_keys[position]; where it completes a block,
    the block's key (the mean of its raw keys, zero-centred RMS-normed, rotated at the block's first position by
    the first 2 * len(inv_freq) dims) written to block_keys[block]. In place, with fixed shapes."""
    index_keys.index_copy_(0, position, raw_key)
    start = (position + 1 - ratio).clamp_min(0)
    pooled = index_keys[start + torch.arange(ratio, device=position.device)].float().mean(0).to(raw_key.dtype)
    freqs = start.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    normed = rms_norm(pooled[None, None], norm_weight, eps, zero_centered=True)
    key = rotary(normed, emb.cos().to(raw_key.dtype), emb.sin().to(raw_key.dtype))[:, 0]
    done = (position + 1) % ratio == 0
    spare = torch.full_like(position, block_keys.shape[0] - 1)  # a row nothing reads while the block is incomplete
    block_keys.index_copy_(0, torch.where(done, (position + 1) // ratio - 1, spare), key)


def qsa_scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Index queries q [T, Hi, Di], block keys [B, Di] -> [T, B] float32: sum_heads relu(q_h . key_b) / sqrt(Di)."""
    scores = torch.matmul(q.float(), blocks.float().T).transpose(-1, -2)  # [T, B, Hi]
    return torch.relu(scores).sum(dim=-1) / q.shape[-1] ** 0.5


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                     group_size: int) -> torch.Tensor:
    """RMSNorm of each `group_size` slice of x [..., groups * g] on its own, with its own slice of weight
    [groups * g] (the hyper-connection streams)."""
    g = group_size
    return rms_norm(x.unflatten(-1, (-1, g)), weight.view(-1, g), eps, zero_centered).flatten(-2)


def inject_rms_norm(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(streams + out scaled per stream, its grouped RMSNorm): streams [T, hc * H], a block's output out [T, H]
    added to stream s at weights[:, s] ([T, hc]); norm_weight [hc * H] (one H-slice per stream)."""
    streams = streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
    return streams, grouped_rms_norm(streams, norm_weight, eps, zero_centered, out.shape[-1])


def hyper_mix(normed: torch.Tensor, projected: torch.Tensor, up_weight: torch.Tensor,
              streams: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A hyper-connection's mix of its normed streams [T, hc * H] into the block input [T, H], given their
    low-rank projection (and injection logits) projected [T, lowrank (+ hc)] and up_weight [hc * H, lowrank];
    returns (block input, injection weights [T, hc], or None when projected holds no injection logits)."""
    lowrank = up_weight.shape[1]
    low = F.silu(projected[:, :lowrank] / streams)
    gates = torch.sigmoid(linear(low, up_weight, None)).unflatten(-1, (streams, -1))  # [T, hc, H]
    mixed = (gates * normed.unflatten(-1, (streams, -1))).mean(dim=-2)
    if projected.shape[-1] == lowrank:
        return mixed, None
    return mixed, 2 * torch.sigmoid(projected[:, lowrank:] / streams)


def stage_plan(table: torch.Tensor, ids: torch.Tensor, host_base: int, host_end: int, slot_base: int,
               slot_stride: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table a batched step's entries read, each slot's host source or 0): the distinct ids whose record is
    in [host_base, host_end), in order of first entry, take device slots while there are any; the rest read in
    place."""
    staged, sources, rank = table.clone(), torch.zeros(capacity, dtype=torch.int64), 0
    for e in dict.fromkeys(ids.tolist()):
        src = int(table[e])
        if host_base <= src < host_end:
            if rank < capacity:
                staged[e], sources[rank] = slot_base + rank * slot_stride, src
            rank += 1
    return staged, sources


def placed_tiles(ids: torch.Tensor, table: torch.Tensor, uses: torch.Tensor, bm: int, tail_bm: int,
                 entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(full [3, N // bm + E], tail [3, E]) tile rows (address, first position, count) over ids [N] (the expert of
    each flat routing entry), as `expert_mlp.prefill_tiles` splits each expert's entries in their stable sort:
    full-height tiles experts in id order, then empty ones; expert e's last tile of at most `tail_bm` entries in
    tail column e (count 0: none; tail_bm < bm). uses [E] gains 1 for each expert used. `entries`: only the first
    ones are tiled (a padded prompt's own; the stable sort keeps them ahead of the rest of their expert's)."""
    experts = table.shape[0]
    every = torch.bincount(ids, minlength=experts)
    counts = every if entries is None else torch.bincount(ids[:entries], minlength=experts)
    offsets = every.cumsum(0) - every
    tail = torch.stack([table, offsets + counts // bm * bm, torch.zeros_like(offsets)]).to(torch.int64)
    full: list[tuple[int, int, int]] = []
    for e, (count, offset) in enumerate(zip(counts.tolist(), offsets.tolist())):
        for m0 in range(0, count, bm):
            n = min(bm, count - m0)
            if n <= tail_bm:
                tail[2, e] = n
            else:
                full.append((int(table[e]), offset + m0, n))
    rows = torch.zeros(3, ids.shape[0] // bm + experts, dtype=torch.int64)
    if full:
        rows[:, : len(full)] = torch.tensor(full, dtype=torch.int64).T
    uses += (counts > 0).to(uses.dtype)
    return rows.to(ids.device), tail
