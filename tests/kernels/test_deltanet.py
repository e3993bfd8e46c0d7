"""The Triton DeltaNet decode kernels equal their torch references: the conv step, the recurrent step (with and
without the gated norm, fused into it or a launch of its own), the gated norm and the whole step between the
projections, on tiny, ragged and flagship-sized heads, over several chained steps with the states updated in
place; and a prompt's rows through fla's chunked kernels. Runs on CUDA, or on CPU under TRITON_INTERPRET=1
(not fla's)."""

import os

import pytest
import torch

from moestream.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
DTYPE = torch.float32 if INTERPRET else torch.bfloat16  # the interpreter (numpy) has no bf16 arithmetic
TOL = dict(atol=1e-5, rtol=1e-5) if INTERPRET else dict(atol=2e-2, rtol=2e-2)
STATE_TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 either way: only the order of the sums differs
# (Nk, Hv, Dk, Dv): tiny, GQA 1..3, ragged, the flagship's, and heads too big for one program (split columns)
HEADS = [(2, 4, 8, 8), (2, 4, 16, 16), (1, 3, 24, 40), (4, 8, 32, 32), (2, 6, 48, 96), (16, 48, 128, 128),
         (2, 4, 256, 256), (1, 2, 200, 100)]
STEPS = 3


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the launchers allocate starts as NaN, so a value a kernel does not write shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: empty(*shape, **kw).fill_(float("nan")))


def randn(*shape, gen, scale=1.0, dtype=DTYPE):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def params(hv, dv, gen):
    """A_log, dt_bias [Hv] and the norm weight [Dv], in the activation dtype as the loader makes them."""
    return randn(hv, gen=gen, scale=0.5), randn(hv, gen=gen), randn(dv, gen=gen, scale=0.1) + 1


@pytest.mark.parametrize("tokens,key_dim,channels,kernel", [(2, 32, 100, 4), (5, 16, 48, 2), (300, 256, 1280, 4),
                                                            (33, 8, 40, 3)])
def test_conv_prefill_matches_reference(poisoned, tokens, key_dim, channels, kernel):
    """A prompt's conv: the reference's outputs as contiguous q, k and v, and the state shifted to end with the
    prompt's last rows, over chained prompts (a row stride wider than the channels, as a fused projection's)."""
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    gen = torch.Generator().manual_seed(1)
    weight = randn(channels, 1, kernel, gen=gen, scale=0.5)
    state = randn(kernel - 1, channels, gen=gen)
    want_state = state.clone()
    for _ in range(2):
        x = randn(tokens, channels + 7, gen=gen)[:, :channels]
        q, k, v = deltanet.conv_prefill(x, state, weight, key_dim)
        want, new = reference.causal_conv1d(x, want_state, weight)
        want_state.copy_(new)
        assert all(part.is_contiguous() and part.dtype == x.dtype for part in (q, k, v))
        torch.testing.assert_close(torch.cat([q, k, v], dim=-1), want, **TOL)
        torch.testing.assert_close(state, want_state, atol=0, rtol=0)


@pytest.mark.parametrize("channels,kernel", [(10240, 4), (100, 4), (48, 2), (33, 3)])
def test_conv_step_matches_reference(poisoned, channels, kernel):
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    gen = torch.Generator().manual_seed(0)
    weight = randn(channels, 1, kernel, gen=gen, scale=0.5)
    state = randn(kernel - 1, channels, gen=gen)
    want_state = state.clone()
    for _ in range(STEPS):
        x = randn(1, channels, gen=gen)
        got = deltanet.conv_step(x, state, weight)
        want, new = reference.causal_conv1d(x, want_state, weight)
        want_state.copy_(new)
        assert got.dtype == x.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(state, want_state, atol=0, rtol=0)  # shifted in place, values moved as they are


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("nk,hv,dk,dv", HEADS)
def test_recurrent_step_matches_reference(poisoned, nk, hv, dk, dv, norm, activation):
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    gen = torch.Generator().manual_seed(1)
    a_log, dt_bias, weight = params(hv, dv, gen)
    state = randn(hv, dk, dv, gen=gen, scale=0.1, dtype=torch.float32)
    want_state = state.clone()
    for _ in range(STEPS):
        mixed = randn(1, 2 * nk * dk + hv * dv, gen=gen)
        b, a = randn(1, hv, gen=gen, scale=2), randn(1, hv, gen=gen, scale=2)
        z = randn(1, hv, dv, gen=gen) if norm else None
        got = deltanet.recurrent_step(mixed, b, a, a_log, dt_bias, state, z, weight, 1e-6, activation)
        want = reference.deltanet_recurrent(mixed, b, a, a_log, dt_bias, want_state).to(DTYPE)
        if norm:
            want = reference.gated_rms_norm(want, z, weight, 1e-6, activation)
        assert got.dtype == DTYPE and got.shape == want.shape == (1, hv, dv)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(state, want_state, **STATE_TOL)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("rows,dim", [(48, 128), (4, 16), (3, 100), (2, 2048)])
def test_gated_rms_norm_matches_reference(poisoned, rows, dim, activation):
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    gen = torch.Generator().manual_seed(2)
    x, gate = randn(1, rows, dim, gen=gen, scale=3), randn(1, rows, dim, gen=gen, scale=2)
    weight = randn(dim, gen=gen, scale=0.1) + 1
    got = deltanet.gated_rms_norm(x, gate, weight, 1e-6, activation)
    want = reference.gated_rms_norm(x, gate, weight, 1e-6, activation)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


def layer(nk: int, hv: int, dk: int, dv: int, seed: int):
    """A layer's generator, channels, parameters and zero states (conv [3, channels], recurrent [hv, dk, dv])."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * nk * dk + hv * dv
    a_log, dt_bias, weight = params(hv, dv, gen)
    conv_weight = randn(channels, 1, 4, gen=gen, scale=0.5)
    conv_state, state = torch.zeros(3, channels, dtype=DTYPE, device=DEVICE), torch.zeros(hv, dk, dv, device=DEVICE)
    return gen, channels, a_log, dt_bias, weight, conv_weight, conv_state, state


@pytest.mark.parametrize("nk,hv,dk,dv", [HEADS[1], HEADS[2], HEADS[5], HEADS[6]])
def test_deltanet_step_chains_like_reference(poisoned, nk, hv, dk, dv):
    """Several tokens in a row through the dispatcher's Triton step, both states advanced in place."""
    pytest.importorskip("triton")
    from moestream.kernels import deltanet

    gen, channels, a_log, dt_bias, weight, conv_weight, conv_state, state = layer(nk, hv, dk, dv, seed=3)
    want_conv, want_state = conv_state.clone(), state.clone()
    buffers = conv_state.data_ptr(), state.data_ptr()
    for _ in range(STEPS + 2):
        mixed, z = randn(1, channels, gen=gen), randn(1, hv, dv, gen=gen)
        b, a = randn(1, hv, gen=gen), randn(1, hv, gen=gen)
        common = (b, a, conv_weight, a_log, dt_bias, weight, 1e-6, "silu")
        got = deltanet.deltanet_step(mixed, z, *common, conv_state, state)
        want = reference.deltanet_step(mixed, z, *common, want_conv, want_state)
        assert got.shape == want.shape == (1, hv * dv)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(conv_state, want_conv, **TOL)
        torch.testing.assert_close(state, want_state, **STATE_TOL)
    assert (conv_state.data_ptr(), state.data_ptr()) == buffers


@pytest.mark.skipif(INTERPRET, reason="fla's kernels need a GPU")
@pytest.mark.parametrize("tokens", [5, 64, 200])
@pytest.mark.parametrize("nk,hv,dk,dv", [HEADS[1], HEADS[3], HEADS[5]])
def test_deltanet_prefill_chains_like_reference(nk, hv, dk, dv, tokens):
    """A prompt's rows through fla's chunked kernels, twice in a row (a chunked prompt), states advanced in place,
    against the fp32 reference."""
    pytest.importorskip("fla")
    from moestream.kernels import deltanet

    gen, channels, a_log, dt_bias, weight, conv_weight, conv_state, state = layer(nk, hv, dk, dv, seed=5)
    want_conv, want_state = conv_state.clone(), state.clone()
    for _ in range(2):
        mixed, z = randn(tokens, channels, gen=gen), randn(tokens, hv, dv, gen=gen)
        b, a = randn(tokens, hv, gen=gen), randn(tokens, hv, gen=gen)
        common = (b, a, conv_weight, a_log, dt_bias, weight, 1e-6, "silu")
        with torch.inference_mode():
            got = deltanet.deltanet_prefill(mixed, z, *common, conv_state, state)
            want = reference.deltanet_step(mixed, z, *common, want_conv, want_state)
        assert got.shape == want.shape == (tokens, hv * dv)
        assert_close_in_norm(got, want)
        torch.testing.assert_close(conv_state, want_conv, **TOL)  # the same torch conv
        assert_close_in_norm(state, want_state)


def assert_close_in_norm(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-2) -> None:
    """bf16 tensor-core products against fp32: within 1% in norm, no element off by 10% of the largest (a rare one
    is a few bf16 steps off, which an elementwise 2% tolerance failed on an H100)."""
    got, want = got.float(), want.float()
    err, worst = ((got - want).norm() / want.norm()).item(), ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel and worst <= 0.1, f"error {err:.3g} in norm, {worst:.3g} of the largest at worst"


def ptxas_log(dk: int, dv: int, norm: bool) -> str:
    """ptxas's report on the recurrent step compiled for sm_90 with the launcher's tiles (pointers 16-byte
    aligned, as the runtime specialises torch's allocations); needs Triton's compiler, not the interpreter."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from moestream.kernels import deltanet
    from moestream.kernels.triton.deltanet import recurrent_step_kernel as kernel

    bk, bv, fused, warps = deltanet.recurrent_tiles(dk, dv, norm)
    pointers = {"qkv_ptr": "*bf16", "b_ptr": "*bf16", "a_ptr": "*bf16", "a_log_ptr": "*bf16", "dt_bias_ptr": "*bf16",
                "state_ptr": "*fp32", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    consts = dict(NK=16, HV=48, DK=dk, DV=dv, BK=bk, BV=bv, NORM=fused, SILU=False)
    signature = {**pointers, "scale": "fp32", "eps": "fp32", **{name: "constexpr" for name in consts}}
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    compiled = triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        cmd = [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"]
        return f"fused={fused} warps={warps} " + subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


@pytest.mark.parametrize("dk,dv,norm", [(128, 128, True), (256, 256, True), (128, 128, False)])
def test_recurrent_step_does_not_spill_on_sm90(dk, dv, norm):
    """The flagship's fused tile and the split one compile for the H200 without spilling (compiled, not run,
    in a process of its own: the interpreter replaces the compiler)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.kernels.test_deltanet import ptxas_log; print(ptxas_log({dk}, {dv}, {norm}))"
    log = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, log
