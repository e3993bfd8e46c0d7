"""The tensor-core Q4 decode GEMVs (kernels/expert_mma.py) equal the torch reference: the five model types'
geometries, 1 to 8 rows, each warp count, slot tables with gaps and repeats, every output element written. Gluon
kernels do not run under the interpreter: GPU only."""

import pytest
import torch

from moestream.experts.format import RecordLayout
from moestream.kernels import reference
from tests.kernels.test_expert_mlp import make_buffer

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def _check(hidden, inter, rows, top_k, warps=4, warps_down=4, records=None, seed=0, stages=1, scale=1.0):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moestream.kernels import expert_mlp
    from moestream.kernels.expert_mlp import TileConfig

    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build("q4", hidden, inter)
    slots = 2 * top_k + 1
    buf = make_buffer(layout, slots, gen)
    x = (scale * torch.randn(rows, hidden, generator=gen)).to(DEVICE, torch.bfloat16)
    n = rows * top_k
    picks = [(slots - 1 - 2 * (i % top_k) - (i // top_k) % 2) % slots for i in range(n)]  # gaps, repeats
    entries = torch.arange(n, device=DEVICE).flip(0)
    cfg = TileConfig(1, 8, 2048, 16, 1024, warps, stages, 0, warps_down, mma=1)
    out = torch.full((n, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    if records is None:
        addr = torch.tensor([buf[picks[e]].data_ptr() for e in entries.tolist()], device=DEVICE)
        expert_mlp.launch_decode(x, out, entries, addr, layout, top_k, cfg=cfg)
    else:  # graph mode: the table by expert id, entry i's expert records[i]
        table = torch.tensor([buf[s].data_ptr() for s in range(slots)], device=DEVICE)
        ids = torch.tensor([picks[e] for e in entries.tolist()], device=DEVICE)
        expert_mlp.launch_decode(x, out, entries, table, layout, top_k, cfg=cfg, records=ids)
    assert not torch.isnan(out).any(), "an output element was not written"
    assert torch.isfinite(out).all()
    want = torch.empty_like(out)
    for e in range(n):
        reference.expert_group(x, buf, [picks[e]], layout, [(0, 1)], torch.tensor([e], device=DEVICE), top_k, want)
    err = (out.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"relative error {err:.3g}"


@pytest.mark.parametrize("hidden,inter,top_k,rows", [
    (2048, 768, 8, 1), (2048, 768, 8, 4), (2048, 768, 8, 8), (2560, 640, 10, 1), (2560, 640, 10, 8),
    (2048, 1408, 4, 2), (4096, 1536, 8, 1), (4096, 1536, 8, 4), (256, 128, 2, 3), (128, 64, 2, 1)])
def test_matches_reference(hidden, inter, top_k, rows):
    _check(hidden, inter, rows, top_k)


@pytest.mark.parametrize("warps,warps_down", [(2, 2), (4, 2), (8, 4), (2, 4), (8, 8)])
def test_each_warp_count(warps, warps_down):
    _check(2048, 768, 2, 8, warps, warps_down, seed=1)


@pytest.mark.parametrize("hidden,inter,stages", [(2048, 768, 2), (2048, 768, 3), (2560, 640, 2), (4096, 1536, 4),
                                                  (2048, 1408, 3)])
def test_each_ring_of_copy_stages(hidden, inter, stages):
    """Copy stages in a ring of buffers (the last one masked where a stage's groups overrun the row)."""
    _check(hidden, inter, 2, 8, stages=stages, seed=4)


def test_x_of_any_range():
    """x and h stay bf16: activations past fp16's range (65504) give finite, correct outputs."""
    _check(2048, 768, 1, 8, seed=5, scale=3e5)


def test_reads_the_table_by_expert_id():
    _check(2048, 768, 3, 8, records=True, seed=2)


def _outputs(cfgs, rows: int, seed: int) -> list:
    """One Qwen3-30B-shaped step of `rows` rows (8 experts a row over 8 records) under each config, NaN-poisoned."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build("q4", 2048, 768)
    buf = make_buffer(layout, 8, gen)
    x = torch.randn(rows, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    entries = torch.arange(8 * rows, device=DEVICE)
    addr = torch.tensor([buf[i % 8].data_ptr() for i in range(8 * rows)], device=DEVICE)
    outs = []
    for cfg in cfgs:
        out = torch.full((8 * rows, 2048), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        expert_mlp.launch_decode(x, out, entries, addr, layout, 8, cfg=cfg)
        outs.append(out)
    return outs


def test_equals_the_gemv_within_rounding():
    """The same step through the FMA GEMVs and the tensor cores: both are fp32 sums of the same products."""
    from moestream.kernels.expert_mlp import TileConfig

    gemv, mma = (o.float() for o in _outputs([TileConfig(1, 8, 2048, 16, 1024, 4, 1, 0, 4, mma=m) for m in (0, 1)],
                                             1, 3))
    assert (gemv - mma).norm() / gemv.norm() < 4e-3


def test_the_down_launch_trigger_changes_only_timing():
    """The down kernel launched once gate/up has 3 or all copy stages in computes the same bits as at once."""
    from moestream.kernels.expert_mlp import TileConfig

    outs = _outputs([TileConfig(1, 8, 2048, 16, 1024, 2, 3, 0, 4, mma=1, trigger=t) for t in (0, 3, 8)], 2, 10)
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
