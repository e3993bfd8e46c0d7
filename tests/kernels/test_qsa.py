"""QSA's decode-step kernels equal their torch references: the indexer's block key, block scores, the selection
of cache rows (exact ties to the lower block, fewer blocks than the budget, every position class), and decode
attention over listed rows with the output gate. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
TOL = {} if INTERPRET else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim,rot,ratio", [(128, 64, 4), (32, 16, 4), (24, 8, 2)])
def test_block_key_matches_reference(dim, rot, ratio):
    pytest.importorskip("triton")
    from moestream.kernels import qsa

    gen = torch.Generator().manual_seed(0)
    capacity = 16
    weight = (torch.randn(dim, generator=gen) * 0.1).to(DEVICE, DTYPE)
    inv_freq = (1.0 / 1e7 ** (torch.arange(0, rot, 2).float() / rot)).to(DEVICE)
    keys = [torch.randn(capacity, dim, generator=gen).to(DEVICE, DTYPE) for _ in range(2)]
    blocks = [torch.full((capacity // ratio + 1, dim), float("nan"), device=DEVICE, dtype=DTYPE) for _ in range(2)]
    for p in range(capacity):
        raw = torch.randn(1, dim, generator=gen).to(DEVICE, DTYPE)
        position = torch.tensor([p], device=DEVICE)
        qsa.block_key(keys[0], blocks[0], raw, position, ratio, weight, 1e-6, inv_freq)
        reference.qsa_block_key(keys[1], blocks[1], raw, position, ratio, weight, 1e-6, inv_freq)
        assert torch.equal(keys[0][: p + 1], keys[1][: p + 1])
        done = (p + 1) // ratio
        torch.testing.assert_close(blocks[0][:done].float(), blocks[1][:done].float(), **TOL)


@pytest.mark.parametrize("heads,dim,blocks", [(16, 128, 2048), (2, 32, 37), (1, 16, 5)])
def test_scores_match_reference(heads, dim, blocks):
    pytest.importorskip("triton")
    from moestream.kernels import qsa

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, dim, generator=gen).to(DEVICE, DTYPE)
    keys = torch.randn(blocks, dim, generator=gen).to(DEVICE, DTYPE)
    got = qsa.scores(q, keys)
    assert got.shape == (blocks,) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference.qsa_scores(q, keys)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("blocks,ratio,topk", [(64, 4, 8), (9, 4, 16), (2048, 4, 512), (40, 2, 3)])
def test_rows_match_reference_with_ties(blocks, ratio, topk):
    """Scores with many exact ties (zeros, repeated values): the same rows, in the same order, at every position
    class (no block complete, fewer complete blocks than the budget, more)."""
    pytest.importorskip("triton")
    from moestream.kernels import qsa

    gen = torch.Generator().manual_seed(2)
    values = torch.randint(0, 6, (blocks,), generator=gen).float() / 4  # ties everywhere, a quarter zeros
    scores = values.to(DEVICE)
    for p in sorted({0, ratio - 2, ratio - 1, ratio, topk * ratio - 1, topk * ratio + 1, blocks * ratio - 1,
                     blocks * ratio // 2 + 1} & set(range(blocks * ratio))):
        position = torch.tensor([p], device=DEVICE)
        got = qsa.rows(scores, position, ratio, topk)
        want = reference.qsa_rows(scores, position, ratio, topk)
        assert torch.equal(got.cpu(), want.cpu()), p


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim,capacity,entries", [(16, 2, 256, 256, 67), (4, 4, 64, 64, 19),
                                                                  (8, 2, 128, 512, 515)])
def test_attention_over_rows_matches_reference(heads, kv_heads, dim, capacity, entries, gated):
    """Rows in any order with -1 holes, whole splits of holes among them."""
    pytest.importorskip("triton")
    from moestream.kernels.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, dim, generator=gen).to(DEVICE, DTYPE)
    k, v = (torch.randn(capacity, kv_heads, dim, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    rows = torch.randperm(capacity, generator=gen)[:entries] if entries <= capacity else torch.randint(
        0, capacity, (entries,), generator=gen)
    rows[entries // 4: entries // 2] = -1
    rows, position = rows.to(DEVICE), torch.tensor([capacity - 1], device=DEVICE)
    gate = torch.randn(1, heads, 2 * dim, generator=gen).to(DEVICE, DTYPE)[..., dim:] if gated else None
    got = decode_attention(q, k, v, position, dim ** -0.5, rows, gate)
    want = reference.decode_attention(q.float(), k.float(), v.float(), position, dim ** -0.5, rows,
                                      None if gate is None else gate.float())
    torch.testing.assert_close(got.float(), want, **({} if INTERPRET else dict(atol=3e-2, rtol=3e-2)))
