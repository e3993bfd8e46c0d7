"""The Python API's generate/chat honour stop strings exactly as streaming does."""

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams


def test_generate_stops_at_a_stop_string(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        full = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        stop = full.text[len(full.text) // 2:][:2]
        cut = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
        assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    finally:
        llm.close()
