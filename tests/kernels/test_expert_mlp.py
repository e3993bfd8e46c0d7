"""The Triton expert MLP equals its torch reference: shape grid, Q4 and bf16, slot tables with gaps and
repeats, every output element written. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""

import dataclasses
import os

import pytest
import torch

from moestream.experts.format import RecordLayout
from moestream.experts.grouping import AddressedExperts
from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16  # the interpreter (numpy) has no bf16 arithmetic


def make_buffer(layout: RecordLayout, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Random records: random codes, scales and biases so weights stay about +-1/sqrt(in)."""
    buf = torch.zeros(num_slots, layout.stride, dtype=torch.uint8)
    for f in layout.fields:
        view = buf[:, f.offset: f.offset + f.nbytes]
        if f.dtype == "int32":
            view.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, (num_slots, f.nbytes // 4), generator=gen,
                                                       dtype=torch.int32))
            continue
        fan_in = f.shape[1] * (layout.group_size if f.name[-2:] in ("_s", "_b") else 1)
        vals = torch.randn(num_slots, f.nbytes // 2, generator=gen) * fan_in ** -0.5
        if f.name.endswith("_s"):
            vals = vals.abs() / 8
        view.view(torch.bfloat16).copy_(vals.bfloat16())
    return buf.to(DEVICE)


def run_case(precision, hidden, inter, rows, top_k, num_experts, seed=0):
    pytest.importorskip("triton")
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build(precision, hidden, inter)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE, DTYPE)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True).to(DEVICE)
    experts, counts = torch.unique(flat, return_counts=True)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    spans = list(zip(offsets, offsets[1:]))
    # records only for the experts in use (quantizing is slow); the slot table has gaps and runs backwards
    num_slots = 2 * len(experts) + 1
    buf = make_buffer(layout, num_slots, gen)
    slots = [num_slots - 1 - 2 * j for j in range(len(experts))]
    want = torch.full((rows * top_k, hidden), float("nan"), dtype=DTYPE, device=DEVICE)
    got = want.clone()
    reference.expert_group(x, buf, slots, layout, spans, order, top_k, want)
    phase = "decode" if rows <= 16 else "prefill"
    expert_mlp.grouped(x, buf, slots, layout, spans, order, top_k, got, phase)
    assert not torch.isnan(got).any(), "an output element was not written"
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, f"relative error {err:.3g}"
    return err


GRID = [("q4", 64, 64, 1, 2, 8), ("bf16", 64, 64, 3, 2, 8), ("q4", 128, 64, 8, 4, 16), ("q4", 256, 128, 40, 4, 8),
        ("q3", 128, 64, 2, 2, 8), ("q2", 128, 64, 3, 2, 8), ("q3", 128, 128, 40, 2, 8), ("q2", 256, 64, 40, 4, 8)]
if not INTERPRET:
    GRID += [(p, h, i, r, k, e) for p in ("q4", "q3", "q2", "bf16") for (h, i, k, e, rs) in
             [(2048, 768, 8, 128, (1, 4, 8, 256)), (2560, 640, 10, 512, (1, 8, 64)), (2048, 1408, 4, 60, (2, 32)),
              (4096, 1536, 8, 128, (1, 128))] for r in rs]


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(["decode" if c[3] <= 16 else "prefill", *map(str, c)]))
def test_matches_reference(case):
    run_case(*case)


def test_repeated_slot():
    """Two tiles may read the same record (graph mode: one tile per routing entry)."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(3)
    layout = RecordLayout.build("q4", 128, 64)
    buf = make_buffer(layout, 4, gen)
    x = torch.randn(2, 128, generator=gen).to(DEVICE, DTYPE)
    addr = torch.tensor([buf[1].data_ptr()] * 4, device=DEVICE)
    entries = torch.arange(4, device=DEVICE)
    out = torch.full((4, 128), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.launch_decode(x, out, entries, addr, layout, 2)
    want = torch.empty_like(out)
    reference.expert_group(x, buf, [1], layout, [(0, 4)], entries, 2, want)
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "bf16"])
def test_per_entry_reads_the_table_by_expert_id(precision):
    """Graph mode: entry e reads the record at table[ids[e]], a layer's table of addresses by expert id (with
    repeats: two rows may pick one expert)."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(4)
    layout = RecordLayout.build(precision, 128, 64)
    buf = make_buffer(layout, 5, gen)
    x = torch.randn(3, 128, generator=gen).to(DEVICE, DTYPE)
    table = torch.tensor([buf[s].data_ptr() for s in (4, 0, 2, 1)], device=DEVICE)  # expert -> slot 4, 0, 2, 1
    ids = torch.tensor([3, 0, 2, 3, 1, 0], device=DEVICE)
    out = torch.full((6, 128), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.per_entry(x, AddressedExperts(table, ids, layout, None), 2, out)
    want = torch.empty_like(out)
    slot_of = (4, 0, 2, 1)
    for e, expert in enumerate(ids.tolist()):
        entry = torch.tensor([e], device=DEVICE)
        reference.expert_group(x, buf, [slot_of[expert]], layout, [(0, 1)], entry, 2, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("miss", ["q3", "q2"])
def test_per_entry_mixed_precision(miss):
    """Mixed mode in graph mode: the table points at Q4 and low-bit records alike, the record bits say which is
    which, and each precision's launch computes its own entries (and every entry is written once)."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(7)
    q4, low = RecordLayout.build("q4", 128, 64), RecordLayout.build(miss, 128, 64)
    bufs = {"q4": make_buffer(q4, 2, gen), miss: make_buffer(low, 2, gen)}
    where = [("q4", 1), (miss, 0), ("q4", 0), (miss, 1)]  # expert -> (precision, slot)
    table = torch.tensor([bufs[p][s].data_ptr() for p, s in where], device=DEVICE)
    record_bits = torch.tensor([4 if p == "q4" else low.bits for p, _ in where], dtype=torch.int32, device=DEVICE)
    x = torch.randn(3, 128, generator=gen).to(DEVICE, DTYPE)
    ids = torch.tensor([3, 0, 2, 1, 1, 3], device=DEVICE)
    out = torch.full((6, 128), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.per_entry(x, AddressedExperts(table, ids, q4, (low, record_bits)), 2, out)
    want = torch.empty_like(out)
    for e, expert in enumerate(ids.tolist()):
        p, slot = where[expert]
        layout = q4 if p == "q4" else low
        reference.expert_group(x, bufs[p], [slot], layout, [(0, 1)], torch.tensor([e], device=DEVICE), 2, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "q3", "q2", "bf16"])
def test_decode_bf16_activations(precision):
    """Decode reads bf16 activations two per 32-bit load; the arithmetic stays fp32."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(1)
    layout = RecordLayout.build(precision, 256, 128)
    buf = make_buffer(layout, 4, gen)
    x = torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16)
    entries = torch.arange(4, device=DEVICE)
    addr = torch.tensor([buf[i].data_ptr() for i in range(4)], device=DEVICE)
    out = torch.full((4, 256), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    expert_mlp.launch_decode(x, out, entries, addr, layout, 2)
    want = torch.empty(4, 256, device=DEVICE)
    for i in range(4):
        reference.expert_group(x.float(), buf, [i], layout, [(0, 1)], entries[i:i + 1], 2, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want).norm() / want.norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "q3", "q2", "bf16"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_decode_with_prefetch(precision, stages):
    """Decode with the next 1 to 3 chunks' weights loaded while one computes (num_stages 2 to 4): same results,
    and the loads past the last chunk are masked off."""
    from moestream.kernels import expert_mlp
    from moestream.kernels.expert_mlp import TileConfig

    gen = torch.Generator().manual_seed(2)
    layout = RecordLayout.build(precision, 256, 128)
    buf = make_buffer(layout, 3, gen)
    x = torch.randn(2, 256, generator=gen).to(DEVICE, DTYPE)
    entries = torch.arange(4, device=DEVICE)
    addr = torch.tensor([buf[i % 3].data_ptr() for i in range(4)], device=DEVICE)
    out = torch.full((4, 256), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.launch_decode(x, out, entries, addr, layout, 2, cfg=TileConfig(1, 16, 64, 32, 64, 2, stages))
    want = torch.empty(4, 256, dtype=DTYPE, device=DEVICE)
    for i in range(4):
        reference.expert_group(x, buf, [i % 3], layout, [(0, 1)], entries[i:i + 1], 2, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


def _prefill_two_experts(precision: str, hidden: int, inter: int, rows: int, cfg, seed: int) -> None:
    """`rows` rows through each of two experts (entry e uses expert e % 2) with tiles `cfg`, against the reference."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build(precision, hidden, inter)
    buf = make_buffer(layout, 2, gen)
    top_k = 2
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE, DTYPE)
    entries = torch.arange(rows * top_k, device=DEVICE)
    order = torch.cat([entries[0::2], entries[1::2]])
    meta = torch.tensor([[buf[0].data_ptr(), buf[1].data_ptr()], [0, rows], [rows, rows]], device=DEVICE)
    out = torch.full((rows * top_k, hidden), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.launch_prefill(x, out, order, meta[0], meta[1], meta[2], layout, top_k, cfg=cfg)
    want = torch.empty_like(out)
    reference.expert_group(x, buf, [0, 1], layout, [(0, rows), (rows, 2 * rows)], order, top_k, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision,swap", [("q4", 0), ("q3", 0), ("q4", 1), ("q3", 1), ("q2", 1), ("bf16", 1)])
def test_prefill_with_tiles_of_256_rows(precision, swap):
    """BM 256 tiles (a whole expert's rows at 4096 tokens): one tile may hold every entry of an expert; weights
    as the MMA's first operand (swap) or second."""
    from moestream.kernels.expert_mlp import TileConfig

    _prefill_two_experts(precision, 128, 64, 150, TileConfig(256, 64, 64, 64, 64, 8, 2, swap=swap), 4)


def _routed(rows: int, top_k: int, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, list]:
    """Random top-k routing grouped by expert: (order, the spans of the experts that got entries)."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)])
    order = torch.argsort(ids.reshape(-1), stable=True).to(DEVICE)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()
    offsets = [0] + torch.cumsum(torch.tensor(counts), 0).tolist()
    return order, [(offsets[e], offsets[e + 1]) for e in range(num_experts) if counts[e]]


def _decode_two_experts(precision: str, cfg, seed: int) -> None:
    """One row through each of two experts (hidden 192, intermediate 64) with tiles `cfg`, against the reference."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout.build(precision, 192, 64)
    buf = make_buffer(layout, 2, gen)
    x = torch.randn(2, 192, generator=gen).to(DEVICE, DTYPE)
    entries = torch.arange(2, device=DEVICE)
    addr = torch.tensor([buf[0].data_ptr(), buf[1].data_ptr()], device=DEVICE)
    out = torch.full((2, 192), float("nan"), dtype=DTYPE, device=DEVICE)
    expert_mlp.launch_decode(x, out, entries, addr, layout, 1, cfg=cfg)
    want = torch.empty(2, 192, dtype=DTYPE, device=DEVICE)
    for i in range(2):
        reference.expert_group(x, buf, [i], layout, [(0, 1)], entries[i:i + 1], 1, want)
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "q3", "q2", "bf16"])
@pytest.mark.parametrize("stages", [1, 2, 4, (3, 4, 4)])  # (gate/up stages, down's warps, down's stages)
@pytest.mark.parametrize("bk", [64, 128, 256])
def test_decode_chunks_past_k(precision, stages, bk):
    """Decode K chunks need not divide K: the columns past the whole chunks go in power-of-two parts (192 = 128
    + 64 at BK 128, 128 + 64 at BK 256; 64 at BK 256 for down); up to 3 chunks load ahead (three chunks of 64);
    the down kernel may take warps and stages of its own."""
    from moestream.kernels.expert_mlp import TileConfig

    up_stages, *down = stages if isinstance(stages, tuple) else (stages, 0, 0)
    _decode_two_experts(precision, TileConfig(1, 16, bk, 32, 256, 2, up_stages, *down), 5)


@pytest.mark.parametrize("precision", ["q4", "q3", "q2", "bf16"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("bk", [128, 256])
def test_decode_last_chunk_masked(precision, stages, bk):
    """masked_tail: the columns past the whole chunks go as one more chunk, masked past K (192 as 2 x 128 or
    1 x 256; down's 64 as 1 x 128 or 1 x 256), with chunks loaded ahead too."""
    from moestream.kernels.expert_mlp import TileConfig

    _decode_two_experts(precision, TileConfig(1, 16, bk, 32, bk, 2, stages, masked_tail=1), 7)


@pytest.mark.parametrize("rows", [2, 40])
def test_batches_read_entries_in_place(rows):
    """The provider's batches name entries where they sit in the step's grouping (spans, not a gathered copy):
    experts computed in two interleaved batches, out of order, give the same outputs as one batch."""
    from moestream.kernels import expert_mlp

    gen = torch.Generator().manual_seed(6)
    layout = RecordLayout.build("q4", 128, 64)
    top_k, num_experts = 2, 6
    x = torch.randn(rows, 128, generator=gen).to(DEVICE, DTYPE)
    order, spans = _routed(rows, top_k, num_experts, gen)
    buf = make_buffer(layout, len(spans), gen)
    slots = list(range(len(spans)))
    want = torch.full((rows * top_k, 128), float("nan"), dtype=DTYPE, device=DEVICE)
    reference.expert_group(x, buf, slots, layout, spans, order, top_k, want)
    got = torch.full_like(want, float("nan"))
    phase = "decode" if rows <= 16 else "prefill"
    for part in (slots[1::2][::-1], slots[0::2]):
        expert_mlp.grouped(x, buf, part, layout, [spans[j] for j in part], order, top_k, got, phase)
    assert not torch.isnan(got).any()
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "q3", "bf16"])
def test_prefill_tails_in_a_launch_of_their_own(precision):
    """tail_bm: each expert's last tile of at most tail_bm entries goes in a second launch of that height; the
    outputs are the reference's and bit for bit those of one launch (a row's arithmetic is its own)."""
    from moestream.kernels import expert_mlp
    from moestream.kernels.expert_mlp import TileConfig

    gen = torch.Generator().manual_seed(12)
    layout = RecordLayout.build(precision, 128, 64)
    rows, top_k = 100, 2  # ~33 entries an expert: a tile of 32 and a tail each
    x = torch.randn(rows, 128, generator=gen).to(DEVICE, DTYPE)
    order, spans = _routed(rows, top_k, 6, gen)
    buf = make_buffer(layout, len(spans), gen)
    slots = list(range(len(spans)))
    want = torch.empty(rows * top_k, 128, dtype=DTYPE, device=DEVICE)
    reference.expert_group(x, buf, slots, layout, spans, order, top_k, want)
    cfg = TileConfig(32, 64, 64, 64, 64, 4, 2, swap=1)
    assert len(expert_mlp.prefill_tiles(spans, [0] * len(spans), dataclasses.replace(cfg, tail_bm=16))) == 2
    got = [torch.full_like(want, float("nan")) for _ in range(2)]
    for out, tail_bm in zip(got, (0, 16)):
        expert_mlp.grouped(x, buf, slots, layout, spans, order, top_k, out, "prefill",
                           cfg=dataclasses.replace(cfg, tail_bm=tail_bm))
    assert not torch.isnan(got[1]).any()
    if not INTERPRET:  # numpy's matmul (the interpreter's dot) blocks K by the tile's shape
        assert torch.equal(got[0], got[1])
    assert (got[0].float() - got[1].float()).abs().max() <= 1e-4 * want.float().abs().max()
    assert (got[1].float() - want.float()).norm() / want.float().norm() < 2e-2


@pytest.mark.parametrize("precision", ["q4", "q3", "q2"])
@pytest.mark.parametrize("swap", [0, 1])
def test_prefill_codes_over_groups(precision, swap):
    """K tiles of two groups (BK 128): each word's scale and bias are its own group's."""
    from moestream.kernels.expert_mlp import TileConfig

    _prefill_two_experts(precision, 256, 128, 24, TileConfig(64, 64, 128, 64, 128, 4, 2, swap=swap), 11)


@pytest.mark.parametrize("precision,swap", [("q4", 1), ("q4", 0), ("q2", 1), ("bf16", 1), ("q3", 1)])
def test_prefill_gate_and_up_joined(precision, swap):
    """join: each gate/up tile holds BN / 2 gate rows and the same up rows (one MMA a step), over several K steps
    (192 = 3 x 64) and two output blocks (intermediate 64 at BN 64); Q3 falls back to separate tiles."""
    from moestream.kernels.expert_mlp import TileConfig

    cfg = TileConfig(64, 64, 64, 64, 64, 4, 2, swap=swap, join=1)
    _prefill_two_experts(precision, 192, 64, 40, cfg, 10)
