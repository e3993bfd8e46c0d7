"""The dense GEMV equals F.linear for one token: the attention projections' and router's shapes, K not a
multiple of the chunk, small N, K split over programs, with and without bias. Runs on CUDA, or on CPU under
TRITON_INTERPRET=1."""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("n,k,bias", [(5120, 2048, False), (2048, 4096, False), (128, 2048, False),
                                      (3, 96, True), (640, 2560, True), (324, 10240, True), (2560, 6144, False)])
def test_matches_linear(n, k, bias):
    pytest.importorskip("triton")
    from moestream.kernels.dense_gemv import dense_gemv

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if bias else None
    got = dense_gemv(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, n) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, **({} if INTERPRET else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.parametrize("n,k", [(2560, 640), (96, 40), (2048, 768)])
def test_glu_matches_reference(n, k):
    """With `up`, the input is silu(gate) * up, rounded as torch rounds it (reference.glu_linear)."""
    pytest.importorskip("triton")
    from moestream.kernels import reference
    from moestream.kernels.dense_gemv import dense_gemv

    gen = torch.Generator().manual_seed(6)
    gate, up = (torch.randn(1, k, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    got = dense_gemv(gate, w, None, up)
    want = reference.glu_linear(gate.float(), up.float(), w.float())
    assert got.shape == (1, n) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, **({} if INTERPRET else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.parametrize("n,k,glu", [(2560, 640, True), (16480, 2560, False), (100, 72, False), (324, 10240, True),
                                     (248, 320, True)])
def test_rows_match_reference_and_do_not_depend_on_the_batch(n, k, glu):
    """Up to 16 token rows (strided, as views of a fused product are): each row equals the reference, and its bits
    are the same whether it runs alone or beside other rows (batch invariance)."""
    pytest.importorskip("triton")
    from moestream.kernels import reference
    from moestream.kernels.dense_gemv import dense_gemv

    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(16, 3 * k, generator=gen).to(DEVICE, DTYPE)
    x, up = wide[:, :k], wide[:, k: 2 * k]
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    bias = None if glu else torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    got = dense_gemv(x, w, bias, up if glu else None)
    want = reference.glu_linear(x.float(), up.float(), w.float()) if glu else F.linear(x.float(), w.float(),
                                                                                       bias.float())
    assert got.shape == (16, n) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, **({} if INTERPRET else dict(atol=3e-2, rtol=3e-2)))
    for start, rows in ((0, 1), (5, 1), (0, 2), (3, 3), (1, 7)):
        alone = dense_gemv(x[start: start + rows], w, bias, up[start: start + rows] if glu else None)
        assert torch.equal(alone, got[start: start + rows]), (start, rows)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA graph")
def test_split_launches_repeat_their_bits_eagerly_and_in_a_graph():
    """Where K is split, the last program of a block to finish adds the parts and resets its count: launch after
    launch, eager and replayed in a CUDA graph, the same bits, whichever came first."""
    from moestream.kernels.dense_gemv import dense_gemv, plan

    gen = torch.Generator().manual_seed(9)
    n, k = 2048, 4096
    assert plan(n, k)[1] > 1
    x = torch.randn(3, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    first = dense_gemv(x, w, None)
    assert all(torch.equal(dense_gemv(x, w, None), first) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_gemv(x, w, None)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)
    # a weight first launched inside a capture: its graph zeroes counts of its own, eager launches make theirs
    w2 = w.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dense_gemv(x, w2, None)
    assert torch.equal(dense_gemv(x, w2, None), first)
    graph.replay()
    assert torch.equal(out, first)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA graph")
def test_gemvs_after_norms_read_what_the_norm_wrote():
    """A decode step's norm -> GEMV chain, replayed in a CUDA graph on new inputs, equals the reference: each GEMV
    reads what the norm before it wrote on this replay (the hazard a launch overlapping its predecessor would add)."""
    from moestream.kernels import ops, reference

    gen = torch.Generator().manual_seed(11)
    k, layers, eps = 2048, 4, 1e-6
    weights = [(torch.randn(k, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE) for _ in range(layers)]
    norms = [(1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, DTYPE) for _ in range(layers)]

    def chain(x, rms_norm, add_rms_norm, linear):
        h, y = x, linear(rms_norm(x, norms[0], eps, False), weights[0])
        for w, g in zip(weights[1:], norms[1:]):
            h, normed = add_rms_norm(y, h, g, eps, False)
            y = linear(normed, w)
        return y

    x = torch.zeros(1, k, device=DEVICE, dtype=DTYPE)
    chain(x, ops.rms_norm, ops.add_rms_norm, ops.linear)  # compiles and makes the counts outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, ops.rms_norm, ops.add_rms_norm, ops.linear)
    for seed in range(3):
        x.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want = chain(x.float(), reference.rms_norm, reference.add_rms_norm,
                     lambda a, w: F.linear(a, w.float()))
        torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("n,k,experts,top_k,rows", [(128, 2048, 128, 8, 1), (128, 2048, 128, 8, 16),
                                                     (1537, 2560, 512, 10, 3), (60, 96, 60, 4, 2)])
def test_a_routers_launch_routes_its_rows(n, k, experts, top_k, rows):
    """With `route`, the launch's last block routes every row from its first `experts` outputs: the same product,
    and the routing of those logits (rowwise.route's ids; weights as close as two reduction orders), launch after
    launch."""
    pytest.importorskip("triton")
    from moestream.kernels import rowwise
    from moestream.kernels.dense_gemv import Route, dense_gemv

    gen = torch.Generator().manual_seed(10)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    ids_out = torch.full((rows * top_k,), -1, dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        y, weights, ids = dense_gemv(x, w, None, route=Route(experts, top_k, True, DTYPE, ids_out))
        assert torch.equal(y, dense_gemv(x, w, None))
        want_weights, want_ids = rowwise.route(y[:, :experts], top_k, True, DTYPE)
        assert ids.data_ptr() == ids_out.data_ptr() and torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights)
