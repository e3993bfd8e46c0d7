"""The Triton decode-attention kernel equals its torch reference (GQA groups 1..16, head dims 64..256, caches
that are and are not a multiple of the block, positions at the first, a middle and the last row), never
reads the rows past `position` (they hold NaN), and replays in a CUDA graph as `position` moves. Runs on
CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable,
              # the interpreter's scalars are 1-element arrays; a loop bound read from one warns in numpy
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16  # the interpreter (numpy) has no bf16 arithmetic
TOL = dict(atol=1e-4, rtol=1e-4) if INTERPRET else dict(atol=2e-2, rtol=2e-2)


def inputs(hq, hkv, d, c, position, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, d, generator=gen).to(DEVICE, DTYPE)
    k = (torch.randn(c, hkv, d, generator=gen) * 2).to(DEVICE, DTYPE)
    v = torch.randn(c, hkv, d, generator=gen).to(DEVICE, DTYPE)
    k[position + 1:], v[position + 1:] = float("nan"), float("nan")
    return q, k, v, torch.tensor([position], dtype=torch.int64, device=DEVICE)


def want(q, k, v, position, scale):
    return reference.decode_attention(q.float(), k.float(), v.float(), position, scale)


CASES = [(32, 4, 128, 8192, 0), (32, 4, 128, 8192, 77), (32, 4, 128, 8192, 8191), (32, 4, 128, 300, 299),
         (16, 16, 64, 64, 63), (8, 2, 256, 1000, 513), (4, 1, 128, 33, 5), (16, 1, 64, 16, 15),
         (64, 8, 128, 700, 640), (16, 2, 128, 2048, 1500)]


@pytest.mark.parametrize("hq,hkv,d,c,position", CASES)
def test_matches_reference(hq, hkv, d, c, position):
    pytest.importorskip("triton")
    from moestream.kernels import decode_attention

    q, k, v, pos = inputs(hq, hkv, d, c, position)
    got = decode_attention.decode_attention(q, k, v, pos, d ** -0.5)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want(q, k, v, pos, d ** -0.5), **TOL)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_cuda_graph_replay_follows_position():
    pytest.importorskip("triton")
    from moestream.kernels import decode_attention

    hq, hkv, d, c = 32, 4, 128, 4096
    q, k, v, pos = inputs(hq, hkv, d, c, c - 1, seed=3)
    scale = d ** -0.5
    decode_attention.decode_attention(q, k, v, pos, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention.decode_attention(q, k, v, pos, scale)
    k0, v0 = k.clone(), v.clone()
    for position in (0, 1, 63, 64, 255, 256, 1000, 2047, 4095, 17):
        pos.fill_(position)
        k.copy_(k0), v.copy_(v0)  # in place: the graph keeps reading the same buffers
        k[position + 1:], v[position + 1:] = float("nan"), float("nan")
        graph.replay()
        torch.testing.assert_close(out.float(), want(q, k, v, pos, scale), **TOL)


def paged(caches: list[torch.Tensor], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The caches [C, Hkv, D] scattered over one store's rows in a random order, and each one's row map."""
    c = caches[0].shape[0]
    order = torch.randperm(len(caches) * c, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    maps = list(order.view(len(caches), c))
    store = torch.empty(len(caches) * c, *caches[0].shape[1:], dtype=caches[0].dtype, device=DEVICE)
    for cache, row_map in zip(caches, maps):
        store[row_map] = cache
    return store, maps


@pytest.mark.parametrize("hq,hkv,d,c,tokens", [(32, 4, 128, 8192, 5), (32, 4, 128, 8192, 16), (16, 2, 256, 300, 5),
                                                (8, 8, 64, 64, 5)])
def test_a_batch_of_tokens_over_their_own_paged_caches_has_each_alone_bits(hq, hkv, d, c, tokens):
    """Tokens, each over its own sequence's positions, scattered through one paged store by its row map, in one
    launch (gated, the gate a strided view as the projection's is; 16 tokens share programs among more splits): each
    token's bits are those of its launch alone over a cache in place, and equal the reference."""
    pytest.importorskip("triton")
    from moestream.kernels import decode_attention

    positions = ([0, c - 1, c // 3, 5 % c, c // 2] * 4)[:tokens]
    cases = [inputs(hq, hkv, d, c, p, seed=i) for i, p in enumerate(positions)]
    q = torch.cat([case[0] for case in cases])
    (k, maps), (v, _) = paged([case[1] for case in cases]), paged([case[2] for case in cases])
    pos = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    wide = torch.randn(tokens, hq, 2 * d, generator=torch.Generator().manual_seed(9)).to(DEVICE, DTYPE)
    gate = wide[..., d:]
    got = decode_attention.decode_attention(q, k, v, pos, d ** -0.5, gate=gate, maps=maps)
    for i, (qi, ki, vi, p) in enumerate(cases):
        alone = decode_attention.decode_attention(qi, ki, vi, p, d ** -0.5, gate=gate[i: i + 1])
        assert torch.equal(got[i: i + 1], alone), i
    expected = reference.decode_attention(q.float(), k.float(), v.float(), pos, d ** -0.5, gate=gate.float(),
                                          maps=maps)
    torch.testing.assert_close(got.float(), expected, **TOL)
