"""The mixed-decode probe runs Q4 hits and low-bit misses and reports both precisions' counts."""

import json
import sys

from benchmarks.probes import mixed_decode


def test_a_tiny_store_decodes_with_q2_misses(tiny, monkeypatch, capsys):
    store = tiny.store("qwen3_moe", experts=("q4", "q2"))
    monkeypatch.setattr(sys, "argv", ["mixed_decode", store, "--requests", "1", "--tokens", "4", "--tag", "t"])
    mixed_decode.main()
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tag"] == "t" and row["decode_tok_s"][0] > 0
    assert row["totals"]["q4"]["misses"] > 0 and row["totals"]["q2"]["lookups"] > 0
