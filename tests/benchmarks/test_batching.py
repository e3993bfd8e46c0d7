"""The batching benchmark times its streams from the step when all of them decode together."""

from benchmarks.batching import measure
from moestream.engine.llm import LLM


def test_four_streams_decode_together_and_their_row_adds_up(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        row = measure(llm, 4)
    finally:
        llm.close()
    assert row["streams"] == 4 and row["decode_tok_s"] > 0
    assert 0 < row["union_per_layer"] <= 4 * llm.config.num_experts_per_tok and row["misses_per_layer"] == 0
