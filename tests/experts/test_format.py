import pytest
import torch

from moestream.experts.format import PAGE, ExpertGeometry, RecordLayout


@pytest.mark.parametrize("precision", ["q4", "bf16"])
@pytest.mark.parametrize("hidden,inter", [(2048, 768), (2560, 640), (64, 64), (4096, 1536)])
def test_layout_is_page_strided_and_disjoint(precision, hidden, inter):
    layout = RecordLayout.build(precision, hidden, inter)
    assert layout.stride % PAGE == 0 and layout.stride >= layout.record_bytes
    spans = sorted((f.offset, f.offset + f.nbytes) for f in layout.fields)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.record_bytes
    assert [f.name for f in layout.fields][:3] == ["gate_w", "up_w", "down_w"]
    assert RecordLayout.from_json(layout.to_json()) == layout


def test_q4_record_size_matches_cherenkov():
    # Cherenkov's qwen4_exp record (hidden 2560, intermediate 640) holds 2,764,800 bytes.
    assert RecordLayout.build("q4", 2560, 640).record_bytes == 2_764_800


def test_views_alias_the_record():
    layout = RecordLayout.build("q4", 128, 64)
    record = torch.zeros(layout.stride, dtype=torch.uint8)
    views = layout.views(record)
    views["down_s"].fill_(1.0)
    assert record.sum() > 0 and views["gate_w"].shape == (64, 16) and views["down_w"].shape == (128, 8)


def test_q4_needs_group_multiples():
    with pytest.raises(ValueError, match="multiples of 64"):
        RecordLayout.build("q4", 96, 64)


def test_record_ids():
    g = ExpertGeometry(num_layers=3, num_experts=8, hidden_size=64, intermediate_size=64, layer_ids=(0, 1, 2))
    assert g.rid(2, 5) == 21 and g.num_records == 24


def test_misaligned_layout_is_refused():
    """The kernels rely on page-strided records with 64-byte aligned fields (vector loads)."""
    d = RecordLayout.build("q4", 128, 64).to_json()
    RecordLayout.from_json(d)
    with pytest.raises(ValueError, match="aligned"):
        RecordLayout.from_json(d | {"stride": d["stride"] + 64})
    with pytest.raises(ValueError, match="aligned"):
        RecordLayout.from_json(d | {"fields": [f | {"offset": f["offset"] + 2} for f in d["fields"]]})
