"""A hyper-connection (qwen4_exp) as two launches around its [down | inject] GEMV: the previous block's output
injected into the streams together with their grouped RMSNorm (one program per stream row), and the mix of the
normed streams into the block input (one program per token and slice of H columns, reading its rows of the
up weight once). Each rounds to the activation dtype where the torch reference rounds."""

import triton
import triton.language as tl

from moestream.kernels.triton.rowwise import _normed


@triton.jit
def _round(x, dt):
    """fp32 x rounded to dt and back: where the torch reference stores an intermediate."""
    return x.to(dt).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def inject_rms_norm_kernel(streams_ptr, out_ptr, scale_ptr, new_ptr, w_ptr, normed_ptr, eps, HC: tl.constexpr,
                           D: tl.constexpr, BLOCK: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """Program r: row r = t * HC + s of the streams [T * HC, D]. new[r] = streams[r] + out[t] * scale[t, s] (the
    product and the sum rounded to the streams' dtype), normed[r] = its RMSNorm with weight slice s."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    inside = d < D
    dt = streams_ptr.dtype.element_ty
    x = tl.load(streams_ptr + r * D + d, mask=inside, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + (r // HC) * D + d, mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + r).to(tl.float32)  # weights [T, HC] are contiguous: row r's is element r
    x = _round(x + _round(out * scale, dt), dt)
    tl.store(new_ptr + r * D + d, x.to(dt), mask=inside)
    w = tl.load(w_ptr + (r % HC) * D + d, mask=inside, other=0.0).to(tl.float32)
    y = _normed(x, tl.rsqrt(tl.sum(x * x, axis=0) / D + eps), w, dt, ZERO_CENTERED)
    tl.store(normed_ptr + r * D + d, y.to(normed_ptr.dtype.element_ty), mask=inside)


@triton.jit
def hyper_mix_kernel(normed_ptr, proj_ptr, up_ptr, mixed_ptr, weights_ptr, PROJ_STRIDE: tl.constexpr,
                     HC: tl.constexpr, H: tl.constexpr, R: tl.constexpr, HC_BLOCK: tl.constexpr, BH: tl.constexpr,
                     BK: tl.constexpr, INJECT: tl.constexpr):
    """Program (t, j), columns c of block j: low = silu(proj[t, :R] / HC); gate[s, c] = sigmoid(up[s * H + c] . low)
    for every stream s; mixed[t, c] = mean over s of gate[s, c] * normed[t, s * H + c]. Program (t, 0) with INJECT
    also writes weights[t] = 2 sigmoid(proj[t, R:R + HC] / HC). Divisions by HC multiply by 1 / HC, as torch's
    CUDA kernels do for a scalar divisor and for mean."""
    t = tl.program_id(0).to(tl.int64)
    dt = normed_ptr.dtype.element_ty
    s = tl.arange(0, HC_BLOCK)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    live = (s < HC)[:, None] & (c < H)[None, :]  # [HC_BLOCK, BH]
    rows = (s[:, None] * H + c[None, :]).to(tl.int64)  # rows of the up weight [HC * H, R]
    acc = tl.zeros((HC_BLOCK, BH, BK), dtype=tl.float32)
    for k0 in range(0, R, BK):
        k = k0 + tl.arange(0, BK)
        low = _round(tl.load(proj_ptr + t * PROJ_STRIDE + k, mask=k < R, other=0.0).to(tl.float32) * (1.0 / HC), dt)
        low = _round(low * _sigmoid(low), dt)  # silu, as the up projection's input in dt
        w = tl.load(up_ptr + rows[:, :, None] * R + k[None, None, :], mask=live[:, :, None] & (k < R)[None, None, :],
                    other=0.0)
        acc += w.to(tl.float32) * low[None, None, :]
    gate = _round(_sigmoid(_round(tl.sum(acc, axis=2), dt)), dt)  # [HC_BLOCK, BH]
    normed = tl.load(normed_ptr + t * HC * H + rows, mask=live, other=0.0).to(tl.float32)
    mixed = tl.sum(tl.where(live, _round(gate * normed, dt), 0.0), axis=0) * (1.0 / HC)
    tl.store(mixed_ptr + t * H + c, mixed.to(mixed_ptr.dtype.element_ty), mask=c < H)
    if INJECT:
        if tl.program_id(1) == 0:
            logits = tl.load(proj_ptr + t * PROJ_STRIDE + R + s, mask=s < HC, other=0.0).to(tl.float32)
            weights = 2.0 * _round(_sigmoid(_round(logits * (1.0 / HC), dt)), dt)
            tl.store(weights_ptr + t * HC + s, weights.to(weights_ptr.dtype.element_ty), mask=s < HC)
