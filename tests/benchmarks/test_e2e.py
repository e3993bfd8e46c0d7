"""The end-to-end probe's account of a traced block's GPU waits: before its first kernel, between kernels (with how
early the host launched the next), and after its last."""

import gzip
import json

from benchmarks.probes.e2e import gaps


def test_gaps_split_a_blocks_wall_into_lead_busy_idle_and_tail(tmp_path):
    events = [{"cat": "cpu_op", "name": "generate", "ts": 0, "dur": 1000},
              {"cat": "cuda_runtime", "name": "launch", "ts": 10, "dur": 5, "args": {"correlation": 1}},
              {"cat": "kernel", "name": "norm", "ts": 100, "dur": 100, "args": {"correlation": 1}},
              {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 290, "dur": 5, "args": {"correlation": 2}},
              {"cat": "kernel", "name": "gemm", "ts": 300, "dur": 100, "args": {"correlation": 2}},
              {"cat": "kernel", "name": "add", "ts": 350, "dur": 100, "args": {"correlation": 3}}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert gaps(str(path)) == {"lead_us": 100, "busy_us": 250, "idle_us": 100, "tail_us": 550, "gaps": 1,
                               "top": [{"us": 100, "before": "norm", "after": "gemm", "launch_lead_us": 10}]}
