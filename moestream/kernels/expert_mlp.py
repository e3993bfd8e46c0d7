"""Launching the Triton expert MLP: tiles from a CSR grouping (streaming mode) or one tile per routing
entry with addresses gathered on the GPU (graph mode, no host decision).

Tile shapes come from `configs/expert_mlp.json` keyed by phase and geometry; a decode launch always uses
the decode config and a prefill launch the prefill config, whatever is resident, so a row's arithmetic
never depends on the residency.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from dataclasses import dataclass

import torch

from moestream.experts.format import RecordLayout
from moestream.experts.grouping import AddressedExperts, PlacedExperts, expert_order
from moestream.kernels import expert_wgmma
from moestream.kernels.launch import dependent, options

CONFIG_PATH = os.path.join(os.path.dirname(__file__), "configs", "expert_mlp.json")


@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn_gate_up: int
    bk_gate_up: int
    bn_down: int
    bk_down: int
    num_warps: int = 4
    num_stages: int = 3
    warps_down: int = 0  # decode: the down kernel's own warps and stages (0: the same as gate/up's)
    stages_down: int = 0
    swap: int = 0  # prefill: 1 = weights as the MMA's first operand (tiles of BN weight rows x BM entries)
    masked_tail: int = 0  # decode: 1 = the columns past the whole BK chunks as one more chunk, masked, not in parts
    join: int = 0  # prefill: 1 = gate/up tiles of bn_gate_up / 2 gate rows and the same up rows, one MMA a step
    tail_bm: int = 0  # prefill: an expert's last tile of at most tail_bm entries goes in a launch of that height
    wgmma: int = 0  # prefill: 1 = Q4 on Hopper's warpgroup MMA (expert_wgmma.py: 16 x num_warps weight rows a tile)

    @property
    def down(self) -> tuple[int, int]:
        """(num_warps, num_stages) of the down kernel."""
        return self.warps_down or self.num_warps, self.stages_down or self.num_stages


DEFAULTS = {"decode": TileConfig(1, 32, 128, 32, 128, 4, 1), "prefill": TileConfig(128, 64, 64, 128, 128, 8, 4)}


@functools.cache
def _table() -> dict:
    if os.path.isfile(CONFIG_PATH):
        with open(CONFIG_PATH) as f:
            return json.load(f)
    return {}


@functools.cache  # launches ask for it per batch; the table is read once per process
def tile_config(phase: str, layout: RecordLayout) -> TileConfig:
    key = f"{phase}/bits{layout.bits}/h{layout.hidden_size}/i{layout.intermediate_size}"
    # Q3/Q2 decode reads Q4's layout of words: without tiles of their own they take Q4's
    fallback = _table().get(f"{phase}/bits4") if phase == "decode" and layout.bits < 4 else None
    entry = _table().get(key) or _table().get(f"{phase}/bits{layout.bits}") or fallback
    cfg = TileConfig(**entry) if entry else DEFAULTS[phase]
    # Output tiles must divide the matrix, and prefill's K tiles too (decode masks its last K chunk): fall back
    # to the largest power of two that does.
    hidden, inter = layout.hidden_size, layout.intermediate_size
    bk_gate_up, bk_down = cfg.bk_gate_up, cfg.bk_down
    if phase == "prefill":
        bk_gate_up, bk_down = _fit(bk_gate_up, hidden), _fit(bk_down, inter)
    return dataclasses.replace(cfg, bn_gate_up=_fit(cfg.bn_gate_up, inter), bk_gate_up=bk_gate_up,
                               bn_down=_fit(cfg.bn_down, hidden), bk_down=bk_down)


def _fit(block: int, dim: int) -> int:
    while dim % block and block > 16:
        block //= 2
    return block if dim % block == 0 else dim


@functools.cache
def _offsets(layout: RecordLayout) -> dict:
    names = ("gate_w", "gate_h", "gate_s", "gate_b", "up_w", "up_h", "up_s", "up_b", "down_w", "down_h", "down_s",
             "down_b")
    have = {f.name: f.offset for f in layout.fields}
    return {n: have.get(n, 0) for n in names}


def launch_decode(x: torch.Tensor, out: torch.Tensor, entries: torch.Tensor, addr: torch.Tensor,
                  layout: RecordLayout, top_k: int, h: torch.Tensor | None = None,
                  cfg: TileConfig | None = None, records: torch.Tensor | None = None,
                  record_bits: torch.Tensor | None = None, miss_layout: RecordLayout | None = None) -> None:
    """Routing entry entries[i] computed with the record at addr[i] (or at addr[records[i]]: addr a layer's
    table by expert id), as GEMVs that never unpack a tile. x [T, H]; out [T * top_k, H]. With `record_bits` (by
    expert id, as addr), only the entries whose record has `layout`'s bits, and with `miss_layout` the others too:
    in the same launches where the two precisions' tiles agree on the grid (else in launches of their own)."""
    from moestream.kernels.triton.expert_gemv import down_gemv_kernel, gate_up_gemv_kernel

    cfg = cfg or tile_config("decode", layout)
    if miss_layout is not None and not _joins(cfg, layout, miss_layout):
        for each in (layout, miss_layout):
            launch_decode(x, out, entries, addr, each, top_k, h, None if each is miss_layout else cfg, records,
                          record_bits)
        return
    hidden, inter = layout.hidden_size, layout.intermediate_size
    n = entries.shape[0]
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device) if h is None else h
    indirect = records is not None
    records = records if indirect else entries  # unread unless indirect
    select = record_bits is not None
    record_bits = record_bits if select else entries  # unread unless select
    # decode "stages": S = S - 1 chunks' loads in flight (up to 3) while one computes
    (warps_down, stages_down), ahead = cfg.down, min(cfg.num_stages - 1, 3)
    pdl = dependent(x)  # the down GEMV starts while gate/up runs
    (gate_up, gate_up_named), (down, down_named) = _precision_args(layout, cfg, "", True)
    (miss_gate_up, miss_gate_up_named), (miss_down, miss_down_named) = _precision_args(
        miss_layout or layout, tile_config("decode", miss_layout or layout), "MISS_", miss_layout is not None)
    group = layout.group_size or 64
    gate_up_gemv_kernel[(n, inter // cfg.bn_gate_up)](
        x, h, entries, addr, records, record_bits, *gate_up, *miss_gate_up, H=hidden, I=inter, TOP_K=top_k,
        GROUP=group, BN=cfg.bn_gate_up, AHEAD=ahead, PDL=pdl, INDIRECT=indirect, SELECT=select, **gate_up_named,
        **miss_gate_up_named, num_warps=cfg.num_warps, num_stages=1)
    down_gemv_kernel[(n, hidden // cfg.bn_down)](
        h, out, entries, addr, records, record_bits, *down, *miss_down, H=hidden, I=inter, GROUP=group,
        BN=cfg.bn_down, AHEAD=min(stages_down - 1, 3), PDL=pdl, INDIRECT=indirect, SELECT=select, **down_named,
        **miss_down_named, num_warps=warps_down, num_stages=1, **options(pdl))


def _joins(cfg: TileConfig, layout: RecordLayout, miss_layout: RecordLayout) -> bool:
    """Whether the miss layout's decode tiles fit the base launch's grid and stages (its warps are the base's)."""
    other = tile_config("decode", miss_layout)
    return (cfg.bn_gate_up, cfg.bn_down, cfg.num_stages, cfg.down[1], layout.group_size) == \
        (other.bn_gate_up, other.bn_down, other.num_stages, other.down[1], miss_layout.group_size)


@functools.cache
def _precision_args(layout: RecordLayout, cfg: TileConfig, prefix: str, used: bool) -> tuple:
    """For the gate/up and down launches, one precision's (positional: field offsets and code mask; named with
    `prefix`: bits and chunks). An unused miss slot has bits 0, so its code is never traced."""
    o = _offsets(layout)
    # where a code lands in the mantissa of 1.0 (see _codes_dot); Q3's codes are placed as Q4 nibbles
    placed = 4 if layout.bits == 3 else layout.bits
    field_mask = 0 if layout.bits == 16 else ((1 << placed) - 1) << (23 - placed)
    fields = (("gate_w", "gate_h", "gate_s", "gate_b", "up_w", "up_h", "up_s", "up_b"), layout.hidden_size,
              cfg.bk_gate_up), (("down_w", "down_h", "down_s", "down_b"), layout.intermediate_size, cfg.bk_down)
    return tuple((tuple(o[name] for name in names) + (field_mask,),
                  {prefix + key: value if used else 0 for key, value in
                   {"BITS": layout.bits, **_chunks(k, bk, cfg.masked_tail)}.items()})
                 for names, k, bk in fields)


@functools.cache
def _chunks(k: int, bk: int, masked_tail: int) -> dict:
    """A decode GEMV's chunks of K: BK, the columns the chunk loop covers (SPAN), and the columns past it in up
    to two power-of-two parts (the last one masked where two do not fit it exactly): 768 = 512 + 256 at BK 1024;
    2560 = 2048 + 512 at BK 2048. `masked_tail` covers them with one more chunk, masked: at BK >= K each row reads
    in one piece, where a Q3/Q2 row of 768 columns (192 bytes) split 512 + 256 reads 128-byte lines in parts."""
    if masked_tail:
        return {"BK": bk, "SPAN": -(-k // bk) * bk, "TAIL1": 0, "TAIL2": 0}
    rest, parts = k % bk, []
    while rest and len(parts) < 2:
        part = 1 << (rest.bit_length() - 1)
        part = part * 2 if parts and part < rest else part
        parts.append(part)
        rest -= min(part, rest)
    parts += [0] * (2 - len(parts))
    return {"BK": bk, "SPAN": k // bk * bk, "TAIL1": parts[0], "TAIL2": parts[1]}


def launch_prefill(x: torch.Tensor, out: torch.Tensor, entries: torch.Tensor, tile_addr: torch.Tensor,
                   tile_start: torch.Tensor, tile_count: torch.Tensor, layout: RecordLayout, top_k: int,
                   h: torch.Tensor | None = None, cfg: TileConfig | None = None, sparse: bool = False) -> None:
    """Tile i: up to `bm` entries entries[tile_start[i]:][:tile_count[i]] of the expert at tile_addr[i], as
    tensor-core GEMMs over dequantized weight tiles. x [T, H]; out [T * top_k, H]. `sparse`: tiles of no entries
    may be among them (their programs exit)."""
    from moestream.kernels.triton.expert_mlp import down_kernel, gate_up_kernel

    cfg = cfg or tile_config("prefill", layout)
    hidden, inter, o = layout.hidden_size, layout.intermediate_size, _offsets(layout)
    bits, group, tiles = layout.bits, layout.group_size or 64, tile_addr.shape[0]
    h = torch.empty(entries.shape[0], inter, dtype=x.dtype, device=x.device) if h is None else h
    if expert_wgmma.applies(cfg, layout, x, h, out):
        expert_wgmma.launch(x, h, out, entries, tile_addr, tile_start, tile_count, layout, o, top_k, cfg, sparse)
        return
    code_mask = _code_mask(bits)
    join = int(cfg.join and _joinable(layout))
    gate_up_kernel[(tiles, inter * (1 + join) // cfg.bn_gate_up)](
        x, h, entries, tile_addr, tile_start, tile_count, o["gate_w"], o["gate_h"], o["gate_s"], o["gate_b"],
        o["up_w"], o["up_h"], o["up_s"], o["up_b"], code_mask, H=hidden, I=inter, TOP_K=top_k, BITS=bits,
        GROUP=group, BM=cfg.bm, BN=cfg.bn_gate_up, BK=cfg.bk_gate_up, SWAP=cfg.swap, JOIN=join, SPARSE=sparse,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    down_kernel[(tiles, hidden // cfg.bn_down)](
        h, out, entries, tile_addr, tile_start, tile_count, o["down_w"], o["down_h"], o["down_s"], o["down_b"],
        code_mask, H=hidden, I=inter, BITS=bits, GROUP=group, BM=cfg.bm, BN=cfg.bn_down, BK=cfg.bk_down,
        SWAP=cfg.swap, SPARSE=sparse, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _code_mask(bits: int) -> int:
    """The mask of a code in its word plane (Q3's `_w` plane holds two bits), passed at run time so that ptxas
    fuses it into a LOP3; 0 for bf16."""
    return (1 << (2 if bits == 3 else bits)) - 1 if bits < 16 else 0


@functools.cache
def _joinable(layout: RecordLayout) -> bool:
    """Joined gate/up tiles move each up row's base by one distance for its codes and one for its scales and biases
    (`_joined_gate_up`): Q3's high-bit plane would need a third."""
    o = _offsets(layout)
    return layout.bits != 3 and o["up_s"] - o["gate_s"] == o["up_b"] - o["gate_b"]


def grouped(x: torch.Tensor, buffer: torch.Tensor, slots: list[int], layout: RecordLayout,
            spans: list[tuple[int, int]], order: torch.Tensor, top_k: int, out: torch.Tensor, phase: str,
            cfg: TileConfig | None = None) -> None:
    """Streaming mode: expert j (record in `buffer[slots[j]]`) owns order[spans[j][0]:spans[j][1]].

    Prefill tiles cover up to `bm` entries of one expert, found in `order` where they are. Decode tiles
    hold one entry each, exactly as in graph mode, so a decode step computes the same bits whether or not it went
    through the host. `cfg` (benchmarks) replaces the quantized layout's tiles."""
    base, stride, tables = buffer.data_ptr(), buffer.stride(0), _tables(x.device)
    if phase == "decode":  # one tile per entry: the entries, back to back, index the tiles
        addr = [base + slot * stride for (a, b), slot in zip(spans, slots) for _ in range(a, b)]
        launch_decode(x, out, _gathered(spans, order), tables.put([addr])[0], layout, top_k, cfg=cfg)
        tables.launched()
        return
    cfg = cfg or tile_config(phase, layout)
    for tiles_cfg, table in prefill_tiles(spans, [base + slot * stride for slot in slots], cfg):
        meta = tables.put(table)
        launch_prefill(x, out, order, meta[0], meta[1], meta[2], layout, top_k, cfg=tiles_cfg)
        tables.launched()


def prefill_tiles(spans: list[tuple[int, int]], addrs: list[int], cfg: TileConfig) -> list:
    """[(tiles' config, [addr, start, count])]: expert j (record at addrs[j]) in tiles of up to `bm` of its entries
    spans[j]. ~256 entries an expert at 4096 tokens leave half the experts a last tile of ~15 at BM 256: at
    `tail_bm` those go in a launch of that height (resident 30B layer 1.10 -> 0.93 ms; the same bits)."""
    bm, tail_bm = cfg.bm, cfg.tail_bm
    full, tails = ([], [], []), ([], [], [])  # chosen by a bool, not keyed by the config: hashing it cost 2/3
    for (a, b), addr in zip(spans, addrs):
        for m0 in range(a, b, bm):
            n = min(bm, b - m0)
            table = tails if n <= tail_bm else full
            table[0].append(addr)
            table[1].append(m0)
            table[2].append(n)
    out = [(cfg, list(full))] if full[0] else []
    if tails[0]:
        out.append((_tails_of(cfg), list(tails)))
    return out


@functools.cache  # a ring batch asks per launch; dataclasses.replace costs ~7 us
def _tails_of(cfg: TileConfig) -> TileConfig:
    return dataclasses.replace(cfg, bm=cfg.tail_bm)


def placed(x: torch.Tensor, part: PlacedExperts, top_k: int, out: torch.Tensor, phase: str) -> None:
    """A step with every record of its layer in the GPU pool: `grouped`'s tiles (so its bits), built on the device
    from a stable sort of the entries' experts, so the host never waits for the routing."""
    cfg = tile_config("prefill", part.layout)
    full, tail = tile_tables(part.ids, part.table, part.uses, cfg.bm, cfg.tail_bm, part.entries)  # and the uses
    if phase == "decode":  # one tile per entry, as graph mode's (never padded: a padded prompt has 32+ rows)
        assert part.entries is None
        launch_decode(x, out, _identity(part.ids.shape[0], x.device), part.table, part.layout, top_k, records=part.ids)
        return
    order = expert_order(part.ids, part.table.shape[0])
    launch_prefill(x, out, order, *full, part.layout, top_k, cfg=cfg, sparse=True)
    if cfg.tail_bm:
        launch_prefill(x, out, order, *tail, part.layout, top_k, cfg=_tails_of(cfg), sparse=True)


TILE_CHUNK = 1024  # routing entries a program of the tile tables' histogram counts


def tile_tables(ids: torch.Tensor, table: torch.Tensor, uses: torch.Tensor, bm: int, tail_bm: int,
                entries: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.placed_tiles in two launches; `entries` [1] (device): how many of the first entries are tiled."""
    from moestream.kernels.triton.expert_tiles import expert_counts_kernel, tile_tables_kernel

    experts, n = table.shape[0], ids.shape[0]
    block = max(32, 1 << (experts - 1).bit_length())  # the histogram's bins are split over a warp's lanes
    chunks, padded = -(-n // TILE_CHUNK), entries is not None
    counts = torch.empty(1 + padded, chunks, block, dtype=torch.int32, device=ids.device)
    expert_counts_kernel[(chunks,)](ids, counts, ids if entries is None else entries, n, chunks, BLOCK_E=block,
                                    CHUNK=TILE_CHUNK, PADDED=padded, num_warps=4)
    full = torch.empty(3, n // bm + experts, dtype=torch.int64, device=ids.device)
    tail = torch.empty(3, experts, dtype=torch.int64, device=ids.device)
    tiles = max(8, 8192 // block)
    tile_tables_kernel[(-(-full.shape[1] // tiles),)](
        counts, table, uses, full, tail, chunks, full.shape[1], E=experts, BLOCK_E=block,
        SUM_ROWS=max(1, 4096 // block), BM=bm, TAIL_BM=tail_bm, TILES=tiles, PADDED=padded, num_warps=4)
    return full, tail


def _gathered(spans: list[tuple[int, int]], order: torch.Tensor) -> torch.Tensor:
    """The entries of `spans` back to back (a view when the spans are contiguous)."""
    if all(a == end for (a, _), (_, end) in zip(spans[1:], spans)):
        return order[spans[0][0]: spans[-1][1]]
    return torch.cat([order[a:b] for a, b in spans])


class TileTables:
    """Pinned host rows that the kernels read in place: a launch's tile table needs no copy on the compute
    stream, where it would wait behind the ring's record copies on the copy engine. Each of `count` tables is
    rewritten only after the launch that read it has run. Elsewhere (the interpreter) plain CPU tensors."""

    def __init__(self, pinned: bool, count: int = 32):
        self.pinned, self.index = pinned, 0
        self.tables: list[torch.Tensor | None] = [None] * count
        self.events: list = [None] * count

    def put(self, rows: list[list[int]]) -> torch.Tensor:
        """[len(rows), n] int64 holding `rows`, valid until `count` launches later."""
        if not self.pinned:
            return torch.tensor(rows, dtype=torch.int64)
        i, n = self.index, len(rows[0])
        if self.events[i] is not None:
            self.events[i].synchronize()  # the launch that read this table has run
        t = self.tables[i]
        if t is None or t.shape[0] < len(rows) or t.shape[1] < n:  # 3 rows: a prefill table's addr, start, count
            t = self.tables[i] = torch.empty(max(3, len(rows)), max(2 * n, 256), dtype=torch.int64, pin_memory=True)
        view = t[: len(rows), :n]
        view.numpy()[:] = rows
        return view

    def launched(self) -> None:
        if self.pinned:
            self.events[self.index] = torch.cuda.Event()
            self.events[self.index].record()
        self.index = (self.index + 1) % len(self.tables)


_local = threading.local()  # one set of tables per thread: a table is reserved from put() to launched()


def _tables(device: torch.device) -> TileTables:
    if not hasattr(_local, "by_device"):
        _local.by_device = {}
    if device not in _local.by_device:
        _local.by_device[device] = TileTables(device.type == "cuda")
    return _local.by_device[device]


@functools.cache
def _identity(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def per_entry(x: torch.Tensor, part: AddressedExperts, top_k: int, out: torch.Tensor) -> None:
    """Routing entry e = row * top_k + k reads the record at `part.table[part.ids[e]]` (a layer's device addresses
    by expert id), so a decode step needs no host decision. Mixed mode (`part.low_bit`: the miss layout and the
    layer's record bits by expert id): each precision's entries in a launch of its own. With `part.staging`, the
    host-tier records are first copied to device slots, once per expert (kernels/staging.py)."""
    entries = _identity(part.ids.shape[0], x.device)
    table = part.table
    if part.staging is not None:
        from moestream.kernels.staging import stage_host_records

        table = stage_host_records(table, part.ids, part.staging)
    if part.low_bit is None:
        launch_decode(x, out, entries, table, part.layout, top_k, records=part.ids)
        return
    miss_layout, record_bits = part.low_bit
    launch_decode(x, out, entries, table, part.layout, top_k, records=part.ids, record_bits=record_bits,
                  miss_layout=miss_layout)
