"""The Triton row-wise kernels equal their torch references: RMSNorm (plain and zero-centred, power-of-two and
ragged widths), rotary and routing. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16  # the interpreter (numpy) has no bf16 arithmetic


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 4, 128), (7, 2560), (5, 96), (4096, 64)])
def test_matches_reference(shape, zero_centered):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE, DTYPE)
    w = (torch.randn(shape[-1], generator=gen) * 0.1 + (0 if zero_centered else 1)).to(DEVICE, DTYPE)
    got = rowwise.rms_norm(x, w, 1e-6, zero_centered)
    want = reference.rms_norm(x, w, 1e-6, zero_centered)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tokens,heads,head_dim,rot",
                         [(3, 4, 128, 128), (2, 2, 256, 64), (5, 3, 64, 32), (1, 32, 128, 128)])
def test_rotary_matches_reference(tokens, heads, head_dim, rot):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.layers.rotary import Rotary

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, DTYPE)
    cos, sin = Rotary(head_dim, rot / head_dim, 1e6).cos_sin(torch.arange(7, 7 + tokens), DTYPE)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    got = rowwise.rotary(x, cos, sin)
    # the kernel rounds once from fp32; the reference rounds each bf16 product, so compare with fp32 math
    want = reference.rotary(x.float(), cos.float(), sin.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    assert (got.float() - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("experts,top_k,normalise", [(128, 8, True), (512, 10, True), (60, 4, False), (8, 2, True)])
def test_route_matches_reference(experts, top_k, normalise):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise

    gen = torch.Generator().manual_seed(2)
    # distinct logits (k / 16 is exact in bf16 for |k| <= 256): the order of tied experts is not specified
    logits = torch.stack([torch.randperm(experts, generator=gen) - experts // 2 for _ in range(33)]) / 16
    logits = logits.to(DEVICE, DTYPE)
    weights, ids = rowwise.route(logits, top_k, normalise, DTYPE)
    want_weights, want_ids = reference.route(logits, top_k, normalise, DTYPE)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 96)])
def test_add_rms_norm_matches_reference(shape, zero_centered):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise

    gen = torch.Generator().manual_seed(3)
    x, res = ((torch.randn(shape, generator=gen) * 3).to(DEVICE, DTYPE) for _ in range(2))
    w = (torch.randn(shape[-1], generator=gen) * 0.1 + (0 if zero_centered else 1)).to(DEVICE, DTYPE)
    total, normed = rowwise.add_rms_norm(x, res, w, 1e-6, zero_centered)
    want_total, want_normed = reference.add_rms_norm(x, res, w, 1e-6, zero_centered)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed)


@pytest.mark.parametrize("heads,kv_heads,head_dim,rot,gated,qk_norm,zero_centered",
                         [(32, 4, 128, 128, False, True, False), (4, 2, 64, 16, True, True, True),
                          (4, 4, 32, 32, False, False, False), (8, 2, 256, 64, True, True, True)])
def test_qk_norm_rope_cache_matches_reference(heads, kv_heads, head_dim, rot, gated, qk_norm, zero_centered):
    """Every q head (gate halves skipped), the k and v cache rows at `position`, and nothing else written."""
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.layers.rotary import Rotary

    gen = torch.Generator().manual_seed(4)
    width = heads * head_dim * (2 if gated else 1) + 2 * kv_heads * head_dim
    qkv = (torch.randn(1, width, generator=gen) * 2).to(DEVICE, DTYPE)
    norms = [(torch.randn(head_dim, generator=gen) * 0.1 + (0 if zero_centered else 1)).to(DEVICE, DTYPE)
             if qk_norm else None for _ in range(2)]
    position = torch.tensor([5], device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in Rotary(head_dim, rot / head_dim, 1e6).cos_sin(position, DTYPE))
    caches = [torch.full((9, kv_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(4)]
    args = (qkv, heads, kv_heads, head_dim, *norms, 1e-6, zero_centered, cos, sin)
    q = rowwise.qk_norm_rope_cache(*args, caches[0], caches[1], position)
    want = reference.qk_norm_rope_cache(*args, caches[2], caches[3], position)
    # on the GPU a few values differ by an ulp of one of their terms (the rotary test compares in fp32 for the
    # same reason)
    tol = {} if INTERPRET else dict(atol=1e-2, rtol=2e-2)
    assert q.shape == want.shape == (1, heads, head_dim)
    torch.testing.assert_close(q, want, **tol)
    for got, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, ref, equal_nan=True, **tol)  # row 5 written, the others still NaN


def test_qk_norm_rope_cache_of_a_batch_writes_each_tokens_own_paged_rows():
    """Three tokens at their own positions, each through its own sequence's row map into one store, in one launch:
    the bits of each alone into a cache in place, and every other row untouched."""
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.layers.rotary import Rotary

    heads, kv_heads, head_dim = 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, heads * head_dim * 2 + 2 * kv_heads * head_dim, generator=gen).to(DEVICE, DTYPE)
    norms = [(torch.randn(head_dim, generator=gen) * 0.1).to(DEVICE, DTYPE) for _ in range(2)]
    position = torch.tensor([5, 0, 8], device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in Rotary(head_dim, 1.0, 1e6).cos_sin(position, DTYPE))
    maps = list(torch.randperm(27, generator=gen).to(DEVICE).view(3, 9))
    store = [torch.full((27, kv_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(2)]
    alone = [[torch.full((9, kv_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(3)]
             for _ in range(2)]
    args = (heads, kv_heads, head_dim, *norms, 1e-6, True)
    q = rowwise.qk_norm_rope_cache(qkv, *args, cos, sin, *store, position, maps)
    for t in range(3):
        one = rowwise.qk_norm_rope_cache(qkv[t: t + 1], *args, cos[t: t + 1], sin[t: t + 1], alone[0][t],
                                         alone[1][t], position[t: t + 1])
        assert torch.equal(q[t: t + 1], one)
        for rows, cache in zip(store, alone):
            assert torch.equal(rows[maps[t]].nan_to_num(7.0), cache[t].nan_to_num(7.0))


def test_qk_norm_rope_cache_gives_a_token_the_same_bits_in_any_batch():
    """A prompt's tokens span several programs' tiles: each token's q and cache rows are its bits alone."""
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.layers.rotary import Rotary

    heads, kv_heads, head_dim, tokens = 4, 2, 64, 2 * rowwise.GLUE_ROWS + 3
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, DTYPE)
    norms = [(torch.randn(head_dim, generator=gen) * 0.1 + 1).to(DEVICE, DTYPE) for _ in range(2)]
    position = torch.arange(tokens, device=DEVICE) + 2
    cos, sin = (t.to(DEVICE) for t in Rotary(head_dim, 1.0, 1e6).cos_sin(position, DTYPE))
    args = (heads, kv_heads, head_dim, *norms, 1e-6, False)
    caches = [torch.zeros(tokens + 2, kv_heads, head_dim, dtype=DTYPE, device=DEVICE) for _ in range(4)]
    q = rowwise.qk_norm_rope_cache(qkv, *args, cos, sin, *caches[:2], position)
    for t in range(tokens):
        one = rowwise.qk_norm_rope_cache(qkv[t: t + 1], *args, cos[t: t + 1], sin[t: t + 1], *caches[2:],
                                         position[t: t + 1])
        assert torch.equal(q[t: t + 1], one)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
