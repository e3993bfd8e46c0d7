"""The MoE combine kernel equals reference.moe_combine: top-k outputs weighted in k order, with and without the
gated shared expert, widths that are and are not a multiple of the block; inside the next add + RMSNorm, the same
bits as the combine and the add + norm launched apart. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 10, 2560), (3, 8, 2048), (5, 4, 96), (1, 2, 1500)])
def test_matches_reference(tokens, top_k, hidden, shared):
    pytest.importorskip("triton")
    from moestream.kernels.combine import moe_combine

    y, weights, extra = block_output(tokens, top_k, hidden, shared)
    got = moe_combine(y, weights, *extra)
    want = reference.moe_combine(y.float(), weights.float(), *(e if e is None else e.float() for e in extra))
    assert got.shape == (tokens, hidden) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, **({} if INTERPRET else dict(atol=2e-2, rtol=2e-2)))


def block_output(tokens, top_k, hidden, shared, seed=7):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, top_k, hidden, generator=gen).to(DEVICE, DTYPE)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(DEVICE, DTYPE)
    extra = (torch.randn(tokens, hidden, generator=gen).to(DEVICE, DTYPE),
             torch.randn(tokens, 1, generator=gen).to(DEVICE, DTYPE)) if shared else (None, None)
    return y, weights, extra


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 10, 2560), (3, 8, 2048), (5, 4, 96)])
def test_inside_the_next_norm_keeps_the_bits(tokens, top_k, hidden, shared, zero_centered):
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.kernels.combine import combine_add_rms_norm, moe_combine

    y, weights, extra = block_output(tokens, top_k, hidden, shared, seed=8)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(9)).to(DEVICE, DTYPE)
    norm = (torch.rand(hidden, generator=torch.Generator().manual_seed(10)) + 0.5).to(DEVICE, DTYPE)
    got = combine_add_rms_norm(x, y, weights, *extra, norm, 1e-6, zero_centered)
    want = rowwise.add_rms_norm(x, moe_combine(y, weights, *extra), norm, 1e-6, zero_centered)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
