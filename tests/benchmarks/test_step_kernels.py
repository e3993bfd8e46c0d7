"""The step-kernels probe's table: launches a step, mean duration, and the idle time after each kernel, with the
host's turn between steps (gaps over 100 us) left out."""

from benchmarks.probes.step_kernels import table


def test_a_kernels_launches_duration_and_the_gap_after_it():
    kernels = [{"name": "norm", "ts": 0.0, "dur": 2.0}, {"name": "gemv", "ts": 2.5, "dur": 8.0},
               {"name": "norm", "ts": 300.0, "dur": 2.0}, {"name": "gemv", "ts": 302.5, "dur": 8.0}]
    rows = {r["kernel"]: r for r in table(kernels, steps=2)}
    assert rows["norm"] == {"kernel": "norm", "a_step": 1.0, "us": 2.0, "gap_after_us": 0.5}
    assert rows["gemv"]["gap_after_us"] == 0.0  # 287.5 us later: the host's turn
    assert [r["kernel"] for r in table(kernels, steps=2)] == ["gemv", "norm"]
