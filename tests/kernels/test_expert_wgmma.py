"""The Q4 prefill tiles on Hopper's warpgroup MMA (kernels/expert_wgmma.py) equal the reference: tile heights of
64-256 entries, 4 and 8 warps, 3-4 stages, tiles holding fewer entries than their height, a K of an odd number of
steps (down's 192), and the tiles they do not take left to the Triton kernels."""

import pytest
import torch

from moestream.experts.format import RecordLayout
from moestream.kernels.expert_mlp import TileConfig
from tests.kernels.test_expert_mlp import _prefill_two_experts

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("bm,warps,stages", [(256, 8, 3), (128, 8, 3), (64, 4, 3), (128, 4, 4)])
@pytest.mark.parametrize("hidden,inter", [(256, 192), (512, 128)])
def test_matches_reference(bm, warps, stages, hidden, inter):
    from moestream.kernels import expert_wgmma

    cfg = TileConfig(bm, 64, 64, 64, 64, warps, stages, wgmma=1)
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda")
    assert expert_wgmma.applies(cfg, RecordLayout.build("q4", hidden, inter), x)
    _prefill_two_experts("q4", hidden, inter, min(bm, 100), cfg, bm + warps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiles_it_does_not_take_run_on_triton():
    """Q3 codes, or a hidden size not a whole number of weight-row blocks: expert_mlp's kernels, the same result."""
    from moestream.kernels import expert_wgmma

    cfg = TileConfig(128, 64, 64, 64, 64, 8, 3, wgmma=1)
    x = torch.zeros(1, 192, dtype=torch.bfloat16, device="cuda")
    assert not expert_wgmma.applies(cfg, RecordLayout.build("q3", 256, 128), x)
    assert not expert_wgmma.applies(cfg, RecordLayout.build("q4", 192, 128), x)
    _prefill_two_experts("q3", 256, 128, 90, cfg, 3)
    _prefill_two_experts("q4", 192, 128, 90, cfg, 4)
