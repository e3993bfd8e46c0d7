"""A placed prefill step's tile tables (reference.placed_tiles, the Triton tile_tables_kernel) and the expert outputs
they give (expert_mlp.placed), against the host's tiles (expert_mlp.prefill_tiles, grouped)."""

import pytest
import torch

from moestream.experts.format import RecordLayout
from moestream.experts.grouping import PlacedExperts
from moestream.kernels import reference
from moestream.kernels.expert_mlp import TileConfig, prefill_tiles


def _routing(rows: int, top_k: int, experts: int, seed: int, skew: bool = False) -> torch.Tensor:
    """Flat expert ids [rows * top_k], distinct within a row; `skew`: most rows pick from the first few experts."""
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(max(top_k, experts // 8) if skew and r % 4 else experts, generator=gen)[:top_k]
             for r in range(rows)]
    return torch.stack(picks).reshape(-1)


def _spans(ids: torch.Tensor, experts: int) -> tuple[list, list[int]]:
    counts = torch.bincount(ids, minlength=experts).tolist()
    offsets = [0] + torch.cumsum(torch.tensor(counts), 0).tolist()
    used = [e for e in range(experts) if counts[e]]
    return [(offsets[e], offsets[e + 1]) for e in used], used


def _tiles(full: torch.Tensor, tail: torch.Tensor) -> tuple[list, list]:
    """The tables' non-empty tiles as (address, start, count), full ones in order, tails sorted."""
    def live(t):
        return [tuple(c) for c in t.T.tolist() if c[2]]
    return live(full), live(tail)


@pytest.mark.parametrize("bm,tail_bm", [(32, 0), (32, 8), (256, 64), (16, 15)])
@pytest.mark.parametrize("skew", [False, True])
def test_placed_tiles_are_the_hosts(bm, tail_bm, skew):
    """The same tiles as the host splits a step's spans into, full ones in expert order; empty ones after."""
    experts, ids = 12, _routing(300, 3, 12, seed=bm + tail_bm, skew=skew)
    table = torch.arange(experts, dtype=torch.int64) * 1000 + 7
    uses = torch.zeros(experts, dtype=torch.int32)
    full, tail = reference.placed_tiles(ids, table, uses, bm, tail_bm)
    spans, used = _spans(ids, experts)
    cfg = TileConfig(bm, 64, 64, 64, 64, tail_bm=tail_bm)
    host = {c.bm: list(zip(*rows)) for c, rows in prefill_tiles(spans, [int(table[e]) for e in used], cfg)}
    got_full, got_tail = _tiles(full, tail)
    assert got_full == host.get(bm, [])
    assert got_tail == sorted(host.get(tail_bm, []))
    assert full.shape == (3, len(ids) // bm + experts)
    assert uses.tolist() == [int(e in used) for e in range(experts)]


def test_a_padded_steps_tiles_are_its_own_entries():
    """With `entries`, only the first entries are tiled, at their places in the stable sort of them all (each
    expert's own entries ahead of the padded ones)."""
    experts, top_k, real = 6, 2, 37
    ids = _routing(64, top_k, experts, seed=5)
    table = torch.arange(experts, dtype=torch.int64) + 100
    full, tail = reference.placed_tiles(ids, table, torch.zeros(experts, dtype=torch.int32), 8, 2,
                                        entries=real * top_k)
    order = torch.argsort(ids, stable=True)
    tiled = sorted(int(order[start + m]) for _, start, count in (*_tiles(full, tail)[0], *_tiles(full, tail)[1])
                   for m in range(count))
    assert tiled == list(range(real * top_k))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,top_k,experts", [(40, 2, 8), (512, 8, 128), (4500, 8, 128), (1000, 10, 512)])
@pytest.mark.parametrize("skew", [False, True])
def test_tile_tables_kernel_matches_reference(rows, top_k, experts, skew):
    pytest.importorskip("triton")
    from moestream.kernels.expert_mlp import tile_tables

    ids = _routing(rows, top_k, experts, seed=rows, skew=skew)
    table = torch.randint(1, 2**40, (experts,), dtype=torch.int64)
    for bm, tail_bm, entries in ((256, 64, None), (128, 0, None), (64, 32, None), (256, 64, rows * top_k // 3)):
        want_uses = torch.full((experts,), 3, dtype=torch.int32)
        want = reference.placed_tiles(ids, table, want_uses, bm, tail_bm, entries)
        uses = torch.full((experts,), 3, dtype=torch.int32, device="cuda")
        real = None if entries is None else torch.tensor([entries], device="cuda")
        got = tile_tables(ids.cuda(), table.cuda(), uses, bm, tail_bm, real)
        for w, g in zip(want, got):
            assert torch.equal(w, g.cpu()), (bm, tail_bm)
        assert torch.equal(uses.cpu(), want_uses)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["q4", "q2", "bf16"])
@pytest.mark.parametrize("rows", [8, 100, 600])
def test_placed_gives_the_hosts_bits(precision, rows):
    """Every output of a placed step is bit for bit the host-grouped step's, at the decode and the prefill phase."""
    pytest.importorskip("triton")
    from moestream.kernels import expert_mlp
    from tests.kernels.test_expert_mlp import make_buffer

    gen = torch.Generator().manual_seed(rows)
    experts, top_k, hidden = 16, 4, 256
    layout = RecordLayout.build(precision, hidden, 128)
    buf = make_buffer(layout, experts, gen).cuda()
    x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    ids = _routing(rows, top_k, experts, seed=rows, skew=True).cuda()
    phase = "decode" if rows <= 16 else "prefill"
    slots = list(range(experts))[::-1]  # expert e in slot experts - 1 - e
    table = torch.tensor([buf[s].data_ptr() for s in slots], device="cuda")
    spans, used = _spans(ids.cpu(), experts)
    order = torch.argsort(ids, stable=True)
    want = torch.full((rows * top_k, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    expert_mlp.grouped(x, buf, [slots[e] for e in used], layout, spans, order, top_k, want, phase)
    got = torch.full_like(want, float("nan"))
    uses = torch.zeros(experts, dtype=torch.int32, device="cuda")
    expert_mlp.placed(x, PlacedExperts(table, ids, layout, uses), top_k, got, phase)
    assert torch.equal(got, want)
    assert uses.tolist() == [int(e in used) for e in range(experts)]

