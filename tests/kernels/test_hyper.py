"""The hyper-connection kernels equal their torch references: the grouped RMSNorm (plain and zero-centred), the
injection of a block's output with the grouped norm, and the mix (with and without injection weights), on tiny
and flagship shapes, every output poisoned before the launch. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
# The interpreter (numpy) has no bf16 arithmetic; its fp16 rounds where torch does, which fp32 would not show.
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16]
# (tokens, hc, H): ragged and power-of-two widths, and the flagship's
SHAPES = [(1, 2, 16), (3, 3, 48), (2, 4, 64), (1, 4, 2560)]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every float tensor the launchers allocate starts as NaN, so an element a kernel misses shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def randn(*shape, gen, dtype, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


def norm_weight(hc, h, zero_centered, gen, dtype):
    return randn(hc * h, gen=gen, dtype=dtype, scale=0.1, shift=0 if zero_centered else 1)


def assert_matches(got, want):
    """fp16 under the interpreter: equal (every intermediate rounded where torch rounds it, which hides the sum
    order); fp32: the sum order shows in ulps; bf16 on the GPU: exp and the sum order differ from torch's by ulps
    before the roundings."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float16:
        assert torch.equal(got, want), (got - want).abs().max()
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("tokens,hc,h", SHAPES)
def test_grouped_rms_norm_matches_reference(tokens, hc, h, zero_centered, dtype):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise

    gen = torch.Generator().manual_seed(tokens * 100 + hc * 10 + h)
    x, w = randn(tokens, hc * h, gen=gen, dtype=dtype, scale=3), norm_weight(hc, h, zero_centered, gen, dtype)
    got = rowwise.grouped_rms_norm(x, w, 1e-6, zero_centered, h)
    want = reference.grouped_rms_norm(x, w, 1e-6, zero_centered, h)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("tokens,hc,h", SHAPES)
def test_inject_rms_norm_matches_reference(tokens, hc, h, zero_centered, dtype):
    pytest.importorskip("triton")
    from moestream.kernels import hyper

    gen = torch.Generator().manual_seed(tokens * 100 + hc * 10 + h + 1)
    streams, out = randn(tokens, hc * h, gen=gen, dtype=dtype, scale=3), randn(tokens, h, gen=gen, dtype=dtype)
    weights = 2 * torch.rand(tokens, hc, generator=gen).to(DEVICE, dtype)
    w = norm_weight(hc, h, zero_centered, gen, dtype)
    got_streams, got = hyper.inject_rms_norm(streams, out, weights, w, 1e-6, zero_centered)
    want_streams, want = reference.inject_rms_norm(streams, out, weights, w, 1e-6, zero_centered)
    if INTERPRET:  # the same two roundings as torch
        assert torch.equal(got_streams, want_streams)
    # on the H200 ~2% of bf16 elements differ by an ulp of the operands' magnitude (where a sum cancels)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got_streams, want_streams, atol=eps * streams.abs().amax().item(), rtol=eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=eps * want.abs().amax().item(), rtol=eps)  # the norm of the above


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("tokens,hc,h,lowrank", [(1, 2, 16, 8), (1, 3, 48, 24), (3, 4, 64, 32), (2, 4, 40, 80),
                                                 (1, 4, 2560, 320)])
def test_hyper_mix_matches_reference(tokens, hc, h, lowrank, inject, dtype):
    """The mix (silu, the up GEMV over K = lowrank in chunks, sigmoid, the mean over streams) and the injection
    weights; projected is a row slice of a wider product, as the fused [down | inject] GEMV hands it over."""
    pytest.importorskip("triton")
    from moestream.kernels import hyper

    gen = torch.Generator().manual_seed(tokens * 1000 + hc * 100 + h + lowrank)
    normed = randn(tokens, hc * h, gen=gen, dtype=dtype)
    projected = randn(tokens, lowrank + hc + 5, gen=gen, dtype=dtype, scale=4)[:, :lowrank + (hc if inject else 0)]
    up = randn(hc * h, lowrank, gen=gen, dtype=dtype, scale=lowrank ** -0.5)
    mixed, weights = hyper.hyper_mix(normed, projected, up, hc)
    want_mixed, want_weights = reference.hyper_mix(normed, projected, up, hc)
    assert mixed.shape == (tokens, h)
    assert_matches(mixed, want_mixed)
    if not inject:
        assert weights is None and want_weights is None
        return
    assert weights.shape == (tokens, hc)
    assert_matches(weights, want_weights)
