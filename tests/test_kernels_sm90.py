"""The Hopper forward (kernels/flash_fwd_sm90.cu) in the emulator's sm_90a: TMA, mbarriers, a
producer warpgroup, wgmma with P̃ from registers; against the float64 reference with
FlashAttention's tolerance rule, in checked mode (races, bounds, every asynchronous hazard),
and bitwise equal under reversed and random block schedules. Its inputs' checks. And the
same kernel on an H100 (`gpu`), for the day one is lent.
"""
import numpy as np
import pytest

from cuflash import _dtypes, reference
from cuflash.backends import kernel_forward_sm90 as sm90
from cuflash.backends import kernels

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, assert_lse_close, attention_inputs,
                      plain_attention, to_host)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
F16, BF16 = np.dtype(np.float16), _dtypes.BFLOAT16


def _backend(checked=False, schedule="round-robin"):
    return kernels.emulator_backend(checked=checked, schedule=schedule, seed=2, arch="sm_90a")


def _check(backend, B, H, Hkv, Nq, Nk, D, causal, seed=0, dtype=F16):
    q, k, v = attention_inputs(B, H, Hkv, Nq, Nk, D, dtype, seed=seed)[:3]
    scale = D ** -0.5
    xp = backend.xp
    o, lse = sm90.forward_sm90(backend, xp.asarray(q), xp.asarray(k), xp.asarray(v),
                               causal=causal, scale=scale)
    kr, vr = (np.repeat(x, H // Hkv, axis=1) for x in (k, v))
    ref_o, ref_lse = reference.naive_attention(q, kr, vr, causal=causal, scale=scale,
                                               return_lse=True)
    plain, _ = plain_attention(q, kr, vr, causal=causal, scale=scale, dtype=dtype)
    assert_close_to_reference(o, ref_o, plain, dtype, what=f"O (D={D}, causal={causal})")
    assert_lse_close(lse, ref_lse, dtype)
    assert to_host(o).dtype == dtype
    return to_host(o), to_host(lse)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", sm90.HEAD_DIMS)
@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,causal", [
    (1, 2, 1, 128, 256, False),    # whole tiles, MQA: the ring wraps
    (2, 4, 2, 200, 300, True),     # GQA, partial query and key tiles, the diagonal inside a tile
    (1, 2, 2, 130, 100, True),     # Nq > Nk: the first 30 rows see no key (O = 0, lse = −inf)
    (1, 1, 1, 5, 1, False),        # one key, a few rows
])
def test_forward(dt, D, B, H, Hkv, Nq, Nk, causal):
    o, lse = _check(_backend(), B, H, Hkv, Nq, Nk, D, causal, seed=Nq + Nk + D, dtype=dt)
    if causal and Nq > Nk:
        assert np.all(o[..., :Nq - Nk, :] == 0) and np.all(np.isneginf(lse[..., :Nq - Nk]))


@pytest.mark.parametrize("D,schedule,dt", [(64, "reversed", F16), (128, "random", BF16)])
def test_checked_and_schedules(D, schedule, dt):
    """No hazard of any kind the emulator checks (a wgmma's A registers, the ring's slots,
    the copies' bytes), and the same bits as round-robin."""
    args = (1, 2, 1, 160, 300, D, True)
    o, lse = _check(_backend(checked=True, schedule=schedule), *args, seed=D, dtype=dt)
    o_rr, lse_rr = _check(_backend(), *args, seed=D, dtype=dt)
    np.testing.assert_array_equal(o, o_rr)
    np.testing.assert_array_equal(lse, lse_rr)


def test_the_consumers_take_turns(monkeypatch):
    """Without warpgroup 1's first arrival on warpgroup 0's named barrier neither consumer
    can issue: the emulator reports the deadlock (the ping-pong is really there)."""
    from cuflash import compiler
    from cuflash.emulator import DeadlockError, RawModule
    source = compiler.read_source(sm90.SOURCE)
    line = "    if (warpgroup == 1) your_turn();"
    assert line in source
    name = sm90.kernel_name(F16, 64)
    mod = RawModule(code=source.replace(line, ""), options=compiler.nvrtc_options(),
                    name_expressions=[name], arch="sm_90a")

    def planted(backend, name, head_dim):
        f = mod.get_function(name)
        f.max_dynamic_shared_size_bytes = sm90.smem_bytes(head_dim)
        return f
    monkeypatch.setattr(sm90, "_function", planted)
    be = _backend()
    q, k, v = attention_inputs(1, 1, 1, 64, 64, 64, F16)[:3]
    with pytest.raises(DeadlockError, match="deadlock"):
        sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)


def test_no_key_and_no_query():
    be = _backend()
    q, k, v = attention_inputs(1, 2, 1, 7, 0, 64, F16)[:3]
    o, lse = sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)
    assert np.all(to_host(o) == 0) and np.all(np.isneginf(to_host(lse)))
    q, k, v = attention_inputs(1, 2, 1, 0, 9, 64, F16)[:3]
    o, lse = sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)
    assert o.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


def test_inputs_it_does_not_take_yet():
    be = _backend()
    q, k, v = attention_inputs(1, 2, 1, 8, 8, 64, F16)[:3]
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        sm90.forward_sm90(be, q.astype(np.float32), k, v, causal=False, scale=1.0)
    with pytest.raises(TypeError, match="alike"):
        sm90.forward_sm90(be, q, k.astype(BF16), v, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="head dims"):
        sm90.forward_sm90(be, *attention_inputs(1, 2, 1, 8, 8, 96, F16)[:3], causal=False, scale=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        sm90.forward_sm90(be, q.transpose(0, 2, 1, 3), k, v, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        sm90.forward_sm90(be, *attention_inputs(1, 3, 2, 8, 8, 64, F16)[:3], causal=False, scale=1.0)
    with pytest.raises(ValueError, match="positive finite scale"):
        sm90.forward_sm90(be, q, k, v, causal=False, scale=-0.5)
    with pytest.raises(ValueError, match="sm_90a"):
        sm90.forward_sm90(kernels.emulator_backend(arch="sm_80"), q, k, v, causal=False, scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", sm90.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu(dt, D, causal):
    """The same launch on an H100: the driver's tensor maps, NVRTC for sm_90a."""
    if not HAS_GPU:
        pytest.skip("no CUDA device")
    be = kernels.cuda_backend()
    if tuple(be.limits()["cc"]) != (9, 0):
        pytest.skip(f"wgmma and TMA need an sm_90 GPU, this is {be.limits()['cc']}")
    _check(be, 2, 8, 2, 1000, 1500, D, causal, seed=D, dtype=dt)
