import numpy as np
import pytest
import torch

from moestream.packer.sources import unpack_bitstream
from moestream.quant.affine import dequantize, pack_codes, quantize, unpack_codes


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (16, 128))
    words = pack_codes(codes, bits)
    assert words.shape == (16, 128 * bits // 32) and words.dtype == torch.int32
    assert torch.equal(unpack_codes(words, bits).long(), codes)
    assert torch.equal(unpack_bitstream(words, bits), codes)


def test_low_nibble_first():
    codes = torch.arange(8).reshape(1, 8)
    word = pack_codes(codes, 4)[0, 0].item() & 0xFFFFFFFF
    assert word == 0x76543210


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_quantize_within_half_step(scale):
    w = (torch.randn(64, 256) * scale).bfloat16()
    w[3, :64] = 0.25  # a constant group
    packed, s, b = quantize(w)
    d = dequantize(packed, s, b)
    step = s.float().repeat_interleave(64, dim=1)
    err = (d - w.float()).abs()
    assert (err <= step / 2 + step * 1e-5).all()
    assert torch.equal(d[3, :64], torch.full((64,), 0.25))


def test_bitstream_matches_numpy_reference():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8, size=(4, 64))
    bits = "".join("".join(str((c >> i) & 1) for i in range(3)) for c in codes[0])
    raw = np.packbits(np.array([int(x) for x in bits], dtype=np.uint8), bitorder="little")
    words = torch.from_numpy(raw.view(np.int32).copy()).reshape(1, -1)
    assert torch.equal(unpack_bitstream(words, 3)[0], torch.from_numpy(codes[0]))
