"""Decode in one launch (TileConfig.fused, triton/expert_fused.py) computes the same bits as the two GEMV
launches: precisions, shapes, slot tables with gaps and repeats, the table by expert id, mixed precision, and
launch after launch (its counters left zeroed), graph-replayed on the GPU. Runs on CPU under TRITON_INTERPRET=1."""

import dataclasses

import pytest
import torch

from moestream.experts.format import RecordLayout
from tests.kernels.test_expert_mlp import DEVICE, DTYPE, INTERPRET, make_buffer

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
TILES = [(1, 16, 128, 32, 64, 2, 2), (1, 8, 2048, 16, 1024, 2, 1), (1, 16, 1024, 32, 256, 4, 2)]
SHAPES = [(192, 64, 1, 2), (128, 64, 3, 2)]  # (hidden, intermediate, rows, top_k)
CASES = [(shape, tiles) for shape in SHAPES for tiles in TILES]
if not INTERPRET:  # the five model types' sizes at the committed tiles' geometry
    CASES += [(shape, TILES[1]) for shape in [(2048, 768, 1, 8), (2048, 768, 4, 8), (2048, 768, 8, 8),
                                              (2560, 640, 8, 10), (2048, 1408, 2, 4), (4096, 1536, 4, 8)]]


def _case(precision, hidden, inter, rows, top_k, seed=0):
    """x, a record buffer with gaps, and entries (reversed) that read it with repeats."""
    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build(precision, hidden, inter)
    slots = top_k + 1
    buf = make_buffer(layout, slots, gen)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE, DTYPE)
    n = rows * top_k
    picks = torch.tensor([(slots - 1 - (i % top_k) - i // top_k) % slots for i in range(n)], device=DEVICE)
    return layout, buf, x, torch.arange(n, device=DEVICE).flip(0), picks


def _both(layout, x, top_k, tiles, n, launch):
    """Outputs of `launch(out, cfg)` with the two-launch tiles, then fused twice (the second launch reads the
    counters the first left)."""
    from moestream.kernels.expert_mlp import TileConfig

    cfg = TileConfig(*tiles)
    outs = []
    for each in (cfg, dataclasses.replace(cfg, fused=1), dataclasses.replace(cfg, fused=1)):
        out = torch.full((n, layout.hidden_size), float("nan"), dtype=DTYPE, device=DEVICE)
        launch(out, each)
        outs.append(out)
    return outs


def _assert_same(outs):
    from moestream.kernels import expert_mlp

    assert not torch.isnan(outs[0]).any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert not expert_mlp._arrival_counts(outs[0].device).any(), "a launch left its counters set"


@pytest.mark.parametrize("precision", ["q4", "bf16", "q3", "q2"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_same_bits_as_two_launches(precision, case):
    from moestream.kernels import expert_mlp

    (hidden, inter, rows, top_k), tiles = case
    layout, buf, x, entries, picks = _case(precision, hidden, inter, rows, top_k)
    addr = torch.tensor([buf[p].data_ptr() for p in picks[entries].tolist()], device=DEVICE)
    _assert_same(_both(layout, x, top_k, tiles, len(entries), lambda out, cfg: expert_mlp.launch_decode(
        x, out, entries, addr, layout, top_k, cfg=cfg)))


@pytest.mark.parametrize("precision", ["q4", "bf16"])
def test_reads_the_table_by_expert_id(precision):
    from moestream.kernels import expert_mlp

    layout, buf, x, entries, picks = _case(precision, 192, 64, 3, 2, seed=1)
    table = torch.tensor([buf[s].data_ptr() for s in range(buf.shape[0])], device=DEVICE)
    ids = picks[entries]
    _assert_same(_both(layout, x, 2, TILES[0], len(entries), lambda out, cfg: expert_mlp.launch_decode(
        x, out, entries, table, layout, 2, cfg=cfg, records=ids)))


@pytest.mark.parametrize("miss", ["q3", "q2"])
def test_mixed_precision(miss):
    """Each precision's launch skips the other's entries, gate/up and down tiles alike (a down tile of a skipped
    entry waiting for its h would never finish)."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(7)
    q4, low = RecordLayout.build("q4", 128, 64), RecordLayout.build(miss, 128, 64)
    bufs = {"q4": make_buffer(q4, 2, gen), miss: make_buffer(low, 2, gen)}
    where = [("q4", 1), (miss, 0), ("q4", 0), (miss, 1)]
    table = torch.tensor([bufs[p][s].data_ptr() for p, s in where], device=DEVICE)
    record_bits = torch.tensor([4 if p == "q4" else low.bits for p, _ in where], dtype=torch.int32, device=DEVICE)
    x = torch.randn(3, 128, generator=gen).to(DEVICE, DTYPE)
    ids = torch.tensor([3, 0, 2, 1, 1, 3], device=DEVICE)
    entries = torch.arange(6, device=DEVICE)

    def launch(out, cfg):
        for each in (q4, low):
            expert_mlp.launch_decode(x, out, entries, table, each, 2, cfg=cfg, records=ids, record_bits=record_bits)
    _assert_same(_both(q4, x, 2, TILES[0], 6, launch))


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="CUDA graphs")
@pytest.mark.parametrize("rows", [1, 4])
def test_graph_replays(rows):
    """Replayed back to back in one graph over changing expert sets, each step equals its eager two-launch
    result: every launch finds its counters zeroed."""
    from moestream.kernels import expert_mlp
    from moestream.kernels.expert_mlp import TileConfig

    layout, buf, x, entries, picks = _case("q4", 2048, 768, rows, 8, seed=2)
    n, steps = len(entries), 6
    tables = [torch.tensor([buf[(p + s) % buf.shape[0]].data_ptr() for p in picks.tolist()], device=DEVICE)
              for s in range(steps)]
    cfg = TileConfig(*TILES[1])
    want = []
    for addr in tables:
        out = torch.empty(n, layout.hidden_size, dtype=DTYPE, device=DEVICE)
        expert_mlp.launch_decode(x, out, entries, addr, layout, 8, cfg=cfg)
        want.append(out)
    fused = dataclasses.replace(cfg, fused=1)
    outs = [torch.empty(n, layout.hidden_size, dtype=DTYPE, device=DEVICE) for _ in range(steps)]
    for out, addr in zip(outs, tables):  # compiled outside the capture
        expert_mlp.launch_decode(x, out, entries, addr, layout, 8, cfg=fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out, addr in zip(outs, tables):
            expert_mlp.launch_decode(x, out, entries, addr, layout, 8, cfg=fused)
    for _ in range(20):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert not expert_mlp._arrival_counts(x.device).any()
