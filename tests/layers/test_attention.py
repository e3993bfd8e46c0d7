"""Prompt attention (layers/attention.py): a whole long prompt goes to cuDNN padded to a multiple of PAD_TO, and its
rows' bits do not depend on the padding."""

import pytest
import torch

from moestream.layers.attention import PAD_TO, causal_attention


def _qkv(t: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, 64, generator=gen) for h in (8, 2, 2))
    return q.to(device, torch.bfloat16), k.to(device, torch.bfloat16), v.to(device, torch.bfloat16)


def _reference(q, k, v):
    k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * 64 ** -0.5
    scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1), -1e30)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


@pytest.mark.gpu
def test_long_prompt_matches_the_reference_and_its_rows_do_not_depend_on_the_padding():
    t = PAD_TO + 200
    q, k, v = _qkv(2 * PAD_TO, "cuda")
    whole = causal_attention(q, k, v, 64 ** -0.5)  # a multiple of PAD_TO: no padding
    torch.testing.assert_close(whole.float(), _reference(q, k, v), atol=2e-2, rtol=2e-2)
    padded = causal_attention(q[:t], k[:t], v[:t], 64 ** -0.5)
    assert padded.shape == (t, 8, 64)
    assert torch.equal(padded, whole[:t])


def test_long_prompt_on_the_cpu_is_plain_causal_attention():
    q, k, v = _qkv(PAD_TO + 40, "cpu")
    torch.testing.assert_close(causal_attention(q, k, v, 64 ** -0.5).float(), _reference(q, k, v), atol=2e-2,
                               rtol=2e-2)
