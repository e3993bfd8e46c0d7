"""The host CPU's Q4 expert kernel against the dequantized weights in float64."""

import pytest
import torch
import torch.nn.functional as F

from moestream.experts.format import RecordLayout
from moestream.kernels import host_experts
from moestream.kernels.reference import expert_weights


def _oracle(x, record, layout):
    gate, up, down = (w.double() for w in expert_weights(record, layout, torch.float32))
    x = x.double()
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("hidden,inter", [(128, 64), (256, 192)])
def test_experts_over_their_entries(hidden, inter):
    layout = RecordLayout.build("q4", hidden, inter)
    if reason := host_experts.unavailable(layout):
        pytest.skip(reason)
    torch.manual_seed(0)
    records = host_experts.random_records(layout, 3)
    top_k, rows = 2, 13
    x = torch.randn(rows, hidden, dtype=torch.bfloat16) * 4
    ids = torch.stack([torch.randperm(3)[:top_k] for _ in range(rows)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=3).tolist()
    spans = [(sum(counts[:j]), sum(counts[: j + 1])) for j in range(3)]
    spans[1] = (spans[1][0], spans[1][0])  # an expert with no entries at all
    y = host_experts.expert_group(x, [r.data_ptr() for r in records], layout, spans, order, top_k, threads=2)
    assert y.shape == (counts[0] + counts[2], hidden) and y.dtype == x.dtype
    want = torch.cat([_oracle(x[order[a:b] // top_k], records[j], layout) for j, (a, b) in enumerate(spans)])
    assert torch.isfinite(y).all()
    assert (y.double() - want).norm() / want.norm() < 5e-3  # h and the outputs rounded to bf16


def test_what_it_cannot_compute():
    for precision in ("q2", "q3", "bf16"):
        assert precision in host_experts.unavailable(RecordLayout.build(precision, 128, 64))
