"""PLE pieces: the n-gram table row reader (bf16 and MLX q4 rows), EOS-aware shifting, and that a forward
reads only the rows it needs."""

import os
from types import SimpleNamespace

import torch

from moestream.engine.llm import LLM
from moestream.experts.format import NgramLayout
from moestream.experts.ngram import NgramTable
from moestream.kernels import reference
from moestream.quant.affine import dequantize, quantize
from tests.packer.helpers import load_manifest, source_tensors


def source_table(ckpt: str) -> torch.Tensor:
    src = source_tensors(ckpt)
    shards = sorted((k for k in src if "ngram_embedding.shard_" in k), key=lambda k: int(k.split("shard_")[1][0]))
    return torch.cat([src[k] for k in shards]).float()


def test_ngram_table_reads_the_checkpoint_rows(tiny):
    store = tiny.store("qwen4_exp")
    (layout,) = load_manifest(store).ngram
    table = NgramTable(os.path.join(store, f"ngram.{layout.layer}.bin"), layout)
    expected = source_table(tiny.checkpoint("qwen4_exp"))
    ids = torch.tensor([[7, 0, layout.rows - 1], [7, 3000, 8]])  # unsorted, repeated, both ends
    raw, inverse = table.read(ids)
    assert torch.equal(reference.ngram_rows(raw, inverse, layout, torch.float32), expected[ids])
    assert table.rows_read == 5  # each distinct row once
    table.load_host(torch.device("cpu"))
    assert torch.equal(reference.ngram_rows(table.host, ids, layout, torch.float32), expected[ids])
    assert table.rows_read == 5 and table.host.shape == (layout.rows, layout.row_bytes)


def test_q4_rows_dequantize_like_mlx(tmp_path):
    rows, dim, group = 100, 64, 32
    weights = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    packed, scales, biases = quantize(weights, 4, group)
    layout = NgramLayout.build(0, rows, dim, "q4", group)
    raw = torch.cat([t.contiguous().view(torch.uint8) for t in (packed, scales, biases)], dim=1)
    assert raw.shape[1] == layout.row_bytes
    path = tmp_path / "ngram.0.bin"
    path.write_bytes(raw.numpy().tobytes())
    ids = torch.tensor([99, 3, 4, 5, 3, 0])
    raw, inverse = NgramTable(str(path), layout).read(ids)
    got = reference.ngram_rows(raw, inverse, layout, torch.float32)
    assert torch.equal(got, dequantize(packed, scales, biases, 4, group)[ids])


def test_eos_shift_matches_transformers():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    eos = 1
    ids = torch.randint(0, 6, (200,), generator=torch.Generator().manual_seed(0))  # EOS about 1 in 6
    ids[:3] = eos
    oracle = Qwen4ExpTextNGramEmbedding._shift_right_ignore_eos
    for shift in range(4):
        expected = oracle(SimpleNamespace(eos_token_id=eos), ids[None], shift)[0]
        assert torch.equal(reference.shift_within_segments(ids, shift, eos), expected), shift


def test_a_forward_reads_only_the_rows_it_needs(tiny, monkeypatch):
    llm = LLM(tiny.store("qwen4_exp"), device="cpu", dtype="float32", experts=16, ngram_tier="disk")
    (ple,) = [m for m in llm.model.modules() if type(m).__name__ == "NgramEmbedding"]
    table, layout = ple.table, ple.table.layout
    reads = []
    pread = os.pread

    def counting_pread(fd, size, offset):
        if fd == table.fd:
            reads.append(size)
        return pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    tokens, heads = 40, ple.ngram_heads_offsets.numel()
    llm.logits(torch.randint(0, 320, (tokens,), generator=torch.Generator().manual_seed(0)))
    assert 0 < sum(reads) <= tokens * heads * layout.row_bytes < layout.rows * layout.row_bytes
    table_size = layout.rows * layout.dim
    assert all(t.numel() < table_size for t in llm.model.state_dict().values())


def test_rows_are_counted_per_tier_and_the_host_table_never_reaches_the_model(tiny):
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for tier in ("disk", "host"):
        llm = LLM(tiny.store("qwen4_exp"), device="cpu", dtype="float32", ngram_tier=tier)
        try:
            logits[tier] = llm.logits(ids)
            stats = llm.stats()["ngram"]
            heads = stats["reads"]["host"]["rows"] if tier == "host" else stats["reads"]["disk"]["rows"]
            assert stats["tier"] == tier and heads > 0, stats
            assert stats["reads"]["disk" if tier == "host" else "host"]["rows"] == 0
            if tier == "host":  # every token reads each of its n-gram heads' rows
                assert heads == 24 * 4
        finally:
            llm.close()
    assert torch.equal(logits["disk"], logits["host"])
