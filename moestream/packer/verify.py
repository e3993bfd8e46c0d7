"""Re-reading what a pack wrote: sampled expert records and dense tensors against the source."""

from __future__ import annotations

import os
import random

import torch
from safetensors import safe_open

from moestream.errors import StoreError
from moestream.experts.format import DENSE_FILE, experts_file
from moestream.packer.records import encode_all


def verify_samples(src, plan, layouts, dense, out, opts) -> None:
    num_layers, num_experts = len(plan.layer_ids), src.model.num_experts
    total = num_layers * num_experts
    rng = random.Random(0)
    rids = sorted({0, total - 1, *rng.sample(range(total), min(total, opts.verify_samples))})
    for rid in rids:
        wanted = encode_all(src, plan, layouts, rid // num_experts, rid % num_experts)
        for precision, layout in layouts.items():
            with open(os.path.join(out, experts_file(precision)), "rb") as f:
                f.seek(rid * layout.stride)
                got = f.read(layout.stride)
            if got != wanted[precision].numpy().tobytes():
                raise StoreError(f"verification failed: record {rid} of {experts_file(precision)} "
                                 "differs from the source after writing")
    with safe_open(os.path.join(out, DENSE_FILE), framework="pt") as f:
        for name in rng.sample(dense, min(len(dense), opts.verify_samples)) + dense[:1]:
            got = f.get_tensor(name)
            want = src.dense(name).to(got.dtype)
            if got.shape != want.shape or not torch.equal(got, want):
                raise StoreError(f"verification failed: dense tensor {name} differs from the source after writing")
