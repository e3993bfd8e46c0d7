"""The suite report's comparison with llama.cpp: each moestream row beside the best llama.cpp variant of the same
scenario, pool and host tier, with the ratio and whether moestream is ahead."""

from benchmarks.report import against_llamacpp


def _row(engine, scenario, tokens, pool, host, rate):
    return {"engine": engine, "scenario": scenario, "tokens": tokens, "pool": pool, "host_tier": host, "rate": rate}


def test_each_row_meets_the_best_llamacpp_variant_of_its_scenario_pool_and_tier():
    runs = [_row("moestream", "decode", 16, 1.0, False, 275.0),
            _row("llama.cpp (GPU)", "decode", 16, 1.0, False, 300.0),
            _row("moestream", "decode", 16, 0.25, True, 63.0),
            _row("llama.cpp --n-cpu-moe 36", "decode", 16, 0.25, True, 46.0),
            _row("llama.cpp --n-cpu-moe 36 --repack 0", "decode", 16, 0.25, True, 50.0),
            _row("moestream", "prefill", 512, 0.5, True, 900.0)]  # no llama.cpp row there: left out
    lines = against_llamacpp(runs, "qwen3-30b")
    assert len(lines) == 4
    assert lines[2] == "| decode 16 | 100% | off | 275.0 | 300.0 (llama.cpp (GPU)) | 0.92x | no |"
    assert lines[3] == "| decode 16 | 25% | on | 63.0 | 50.0 (llama.cpp --n-cpu-moe 36 --repack 0) | 1.26x | yes |"
    assert against_llamacpp(runs[:1], "qwen3-30b") == []
