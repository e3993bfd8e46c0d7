"""The Triton n-gram row ids (hashing) and row gather equal their torch references bit for bit; the gather over
bf16 and q4 tables, ragged dims, group sizes 32 and 64, repeated and unordered ids; on CUDA also a pinned host
table read in place and a captured graph replayed over new ids. Runs on CUDA, or on CPU under TRITON_INTERPRET=1;
the reference's q4 decode is checked on its own on CPU."""

import os

import pytest
import torch

from moestream.experts.format import NgramLayout
from moestream.kernels import reference
from moestream.quant.affine import pack_codes

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
# the interpreter casts fp32 -> bf16 by truncation where the GPU rounds to nearest even
BF16_OUT = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason="interpreter truncates to bf16"))
LAYOUTS = [("bf16", 160, 0), ("bf16", 64, 0), ("q4", 160, 32), ("q4", 64, 32), ("q4", 64, 64), ("q4", 192, 64)]


def make_table(layout: NgramLayout, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Random rows (uint8 [rows, row_bytes], on the CPU) and, for q4, the codes, scales and biases packed in."""
    gen = torch.Generator().manual_seed(seed)
    rows, dim = layout.rows, layout.dim
    if layout.precision == "bf16":
        values = torch.randn(rows, dim, generator=gen).bfloat16()
        return values.view(torch.uint8).reshape(rows, -1).clone(), {"values": values}
    groups = dim // layout.group_size
    codes = torch.randint(0, 16, (rows, dim), generator=gen)
    scales = (torch.rand(rows, groups, generator=gen) / 8 + 1e-3).bfloat16()
    biases = (torch.randn(rows, groups, generator=gen) / 4).bfloat16()
    table = torch.cat([pack_codes(codes, 4).view(torch.uint8), scales.view(torch.uint8), biases.view(torch.uint8)], 1)
    assert table.shape == (rows, layout.row_bytes)
    return table, {"codes": codes, "scales": scales, "biases": biases}


def launch(table, ids, layout, dtype):
    from moestream.kernels import ngram_rows

    return ngram_rows.ngram_rows(table, ids, layout, dtype)


def test_reference_decodes_packed_q4_rows():
    layout = NgramLayout.build(0, 9, 160, "q4", 32)
    table, parts = make_table(layout, seed=4)
    ids = torch.tensor([[3, 0, 8], [3, 3, 5]])
    got = reference.ngram_rows(table, ids, layout, torch.float32)
    # codes * scale + bias from the codes packed in, exact in fp64 and then rounded once, as fp32 math rounds it
    per_group = parts["codes"].view(9, 5, 32).double()
    want = (per_group * parts["scales"].double()[..., None] + parts["biases"].double()[..., None]).view(9, 160)
    assert got.shape == (2, 3, 160)
    torch.testing.assert_close(got, want[ids].float(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.interpretable
@pytest.mark.parametrize("dtype", [torch.float32, BF16_OUT])
@pytest.mark.parametrize("precision,dim,group_size", LAYOUTS)
def test_matches_reference(precision, dim, group_size, dtype):
    pytest.importorskip("triton")
    layout = NgramLayout.build(1, 37, dim, precision, group_size or 32)
    table, _ = make_table(layout, seed=dim + group_size)
    table = table.to(DEVICE)
    ids = torch.tensor([[5, 36, 0, 5], [12, 12, 12, 1], [36, 2, 19, 0]], device=DEVICE)  # repeats, any order
    got = launch(table, ids, layout, dtype)
    assert got.dtype == dtype and got.shape == (3, 4, dim) and got.device == ids.device
    torch.testing.assert_close(got, reference.ngram_rows(table, ids, layout, dtype), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.interpretable
def test_ids_out_of_range_give_zero_rows():
    pytest.importorskip("triton")
    layout = NgramLayout.build(0, 8, 160, "q4", 32)
    table = make_table(layout)[0].to(DEVICE)
    got = launch(table, torch.tensor([2, -1, 8, 1 << 40, 7], device=DEVICE), layout, torch.float32)
    assert not got[[1, 2, 3]].any()
    torch.testing.assert_close(got[[0, 4]], reference.ngram_rows(table, torch.tensor([2, 7], device=DEVICE), layout,
                                                                 torch.float32), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.interpretable
@pytest.mark.parametrize("n,heads_per_ngram,tokens", [(2, 1, 1), (3, 8, 1), (3, 8, 37), (4, 3, 16)])
def test_hashed_ids_match_reference(n, heads_per_ngram, tokens):
    """Every place-back rule (EOS in the context, in the tokens, at the token itself, runs of them), products that
    wrap int64, head sizes of any parity."""
    pytest.importorskip("triton")
    from moestream.kernels import ngram_rows

    gen, eos, heads = torch.Generator().manual_seed(n * 100 + tokens), 151645, (n - 1) * heads_per_ngram
    ids = torch.randint(0, 200_000, (tokens,), generator=gen)
    ids[torch.rand(tokens, generator=gen) < 0.3] = eos
    context = torch.tensor([eos, 7, 9][: n - 1])
    multipliers = torch.randint(-(2 ** 62), 2 ** 62, (n,), generator=gen)
    sizes = torch.randint(1_000, 20_000_000, (heads,), generator=gen)
    offsets = torch.cumsum(sizes, 0) - sizes
    args = [a.to(DEVICE) for a in (ids, context, multipliers, sizes, offsets)]
    got = ngram_rows.ngram_ids(*args, heads_per_ngram, eos)
    want = reference.ngram_ids(ids, context, multipliers, sizes, offsets, heads_per_ngram, eos)
    assert got.shape == (tokens, heads) and torch.equal(got.cpu(), want)


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("precision", ["bf16", "q4"])
def test_pinned_host_table_is_read_in_place(precision):
    layout = NgramLayout.build(2, 301, 160, precision)
    host = make_table(layout, seed=7)[0]
    pinned = torch.empty(host.shape, dtype=torch.uint8, pin_memory=True).copy_(host)
    ids = torch.tensor([300, 0, 17, 17, 150], device="cuda")
    got = launch(pinned, ids, layout, torch.bfloat16)
    torch.testing.assert_close(got, reference.ngram_rows(host, ids, layout, torch.bfloat16), atol=0, rtol=0)
    with pytest.raises(ValueError, match="pinned"):
        launch(host, ids, layout, torch.bfloat16)


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("pinned", [False, True])
def test_cuda_graph_replay_follows_ids(pinned):
    layout = NgramLayout.build(3, 1000, 160, "q4")
    host = make_table(layout, seed=8)[0]
    table = torch.empty(host.shape, dtype=torch.uint8, pin_memory=True).copy_(host) if pinned else host.cuda()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], device="cuda")
    launch(table, ids, layout, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch(table, ids, layout, torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        ids.copy_(torch.randint(0, layout.rows, ids.shape, generator=gen))  # in place: the graph reads this buffer
        graph.replay()
        torch.testing.assert_close(out, reference.ngram_rows(host, ids, layout, torch.bfloat16), atol=0, rtol=0)
