"""One decode token of a Gated DeltaNet layer: the depthwise causal conv step (one program per block of channels,
the conv state shifted in place), the gated delta rule's recurrent step (one program per value head and block of
its Dv columns, the fp32 state read and written once, in place, optionally followed by the output norm when the
block is the whole head) and the gated RMSNorm (one program per head)."""

import triton
import triton.language as tl


@triton.jit
def conv_step_kernel(x_ptr, state_ptr, w_ptr, out_ptr, C: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Channels c of block i: out[c] = silu(sum_j w[c, j] * [state; x][j, c]) in fp32 over values in x's dtype,
    the conv rounded to it before the SiLU (as the reference's); state [K-1, C] becomes its rows 1.. with x
    appended. ROWS = next_power_of_2(K - 1)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = c < C
    j = tl.arange(0, ROWS)
    old = (j < K - 1)[:, None] & live[None, :]
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + c, mask=live, other=0.0)
    rows = tl.load(state_ptr + j[:, None] * C + c[None, :], mask=old, other=0.0)  # [ROWS, BLOCK]
    w = tl.load(w_ptr + c[None, :] * K + j[:, None], mask=old, other=0.0).to(dt).to(tl.float32)
    conv = tl.sum(rows.to(dt).to(tl.float32) * w, axis=0)
    conv += x.to(tl.float32) * tl.load(w_ptr + c * K + (K - 1), mask=live, other=0.0).to(dt).to(tl.float32)
    # every row is loaded above before any is overwritten; each program owns its channels
    tl.store(state_ptr + (j[:, None] - 1) * C + c[None, :], rows, mask=old & (j >= 1)[:, None])
    tl.store(state_ptr + (K - 2) * C + c, x.to(state_ptr.dtype.element_ty), mask=live)
    conv = conv.to(dt).to(tl.float32)
    tl.store(out_ptr + c, (conv * tl.sigmoid(conv)).to(dt), mask=live)


@triton.jit
def conv_prefill_kernel(x_ptr, state_ptr, w_ptr, out_ptr, T, STRIDE_X, C: tl.constexpr, KEY: tl.constexpr,
                        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Rows t of block i, channels c of block j: silu(sum_j w[c, j] * [state; x][t + j, c]), as conv_step_kernel
    rounds, written planar: channels below KEY to q [T, KEY], the next KEY to k, the rest to v [T, C - 2 KEY], one
    after another in out (each contiguous, as the chunked delta rule reads them). The state is not touched."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # rows times a wide stride pass 2^31
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    live = (t < T)[:, None] & (c < C)[None, :]
    dt = x_ptr.dtype.element_ty
    conv = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        r = t[:, None] + (j - (K - 1))  # the row of x, or below 0 the state's row r + K - 1
        from_x = tl.load(x_ptr + r * STRIDE_X + c[None, :], mask=live & (r >= 0), other=0.0)
        from_state = tl.load(state_ptr + (r + K - 1) * C + c[None, :], mask=live & (r < 0), other=0.0)
        w = tl.load(w_ptr + c * K + j, mask=c < C, other=0.0).to(dt).to(tl.float32)
        conv += (from_x.to(tl.float32) + from_state.to(dt).to(tl.float32)) * w[None, :]
    conv = conv.to(dt).to(tl.float32)
    plane = tl.where(c < KEY, 0, tl.where(c < 2 * KEY, 1, 2))
    width = tl.where(plane < 2, KEY, C - 2 * KEY)
    at = plane.to(tl.int64) * T * KEY + t.to(tl.int64)[:, None] * width[None, :] + (c - plane * KEY)[None, :]
    tl.store(out_ptr + at, (conv * tl.sigmoid(conv)).to(dt), mask=live)


@triton.jit
def _softplus(x):
    """torch's softplus: log(1 + exp(x)), x itself past 20; log1p-accurate where exp(x) is tiny."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))


@triton.jit
def _gated_norm(o, z, w, eps, D: tl.constexpr, dt, SILU: tl.constexpr):
    """reference.gated_rms_norm of one row: o fp32 holding dt values (zero past D), z and w fp32."""
    normed = (o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)).to(dt).to(tl.float32)
    y = (w * normed).to(dt).to(tl.float32)
    if SILU:
        return y * (z * tl.sigmoid(z))
    return y * tl.sigmoid(z)


@triton.jit
def recurrent_step_kernel(qkv_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, state_ptr, z_ptr, w_ptr, out_ptr, scale,
                          eps, NK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr):
    """Value head h, columns j of block i: from the conv output qkv [q | k | v] (q, k [NK, DK], v [HV, DV]), head
    h reading key head h // (HV // NK): q, k l2-normed (q times `scale`), beta = sigmoid(b[h]),
    g = -exp(A_log[h]) * softplus(a[h] + dt_bias[h]); S = exp(g) S; delta = beta (v - k^T S); S += k delta^T;
    out = q^T S rounded to out's dtype, or with NORM (BV >= DV) the gated norm of it with z [HV, DV], w [DV]."""
    h = tl.program_id(0)
    kh = h // (HV // NK)
    dt = out_ptr.dtype.element_ty
    i = tl.arange(0, BK)
    j = tl.program_id(1) * BV + tl.arange(0, BV)
    mi, mj = i < DK, j < DV
    q = tl.load(qkv_ptr + kh * DK + i, mask=mi, other=0.0).to(tl.float32)
    k = tl.load(qkv_ptr + NK * DK + kh * DK + i, mask=mi, other=0.0).to(tl.float32)
    v = tl.load(qkv_ptr + 2 * NK * DK + h * DV + j, mask=mj, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    beta = tl.sigmoid(tl.load(b_ptr + h).to(tl.float32))
    softplus = _softplus(tl.load(a_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32))
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    at = state_ptr + h.to(tl.int64) * DK * DV + i[:, None] * DV + j[None, :]
    inside = mi[:, None] & mj[None, :]
    s = tl.load(at, mask=inside, other=0.0) * tl.exp(g)  # [BK, BV]
    delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(at, s, mask=inside)
    o = tl.sum(q[:, None] * s, axis=0).to(dt).to(tl.float32)
    if NORM:
        z = tl.load(z_ptr + h * DV + j, mask=mj, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + j, mask=mj, other=0.0).to(tl.float32)
        o = _gated_norm(o, z, w, eps, DV, dt, SILU)
    tl.store(out_ptr + h * DV + j, o.to(dt), mask=mj)


@triton.jit
def gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr):
    """Row r: out[r] = reference.gated_rms_norm(x[r], z[r], w), rows of D contiguous values."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    x = tl.load(x_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    y = _gated_norm(x, z, w, eps, D, x_ptr.dtype.element_ty, SILU)
    tl.store(out_ptr + r * D + d, y.to(out_ptr.dtype.element_ty), mask=inside)
