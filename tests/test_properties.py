"""Property tests: random shapes, every flag and dtype, against the float64 reference within
FlashAttention's rule (conftest.error_bound against a plain implementation in the same
precision). On the emulator's default arch (sm_80) float16 and bfloat16 with d a multiple
of 8, and float32 with d a multiple of 4, take the tensor-core (split-tf32) kernels; other
head dims and float64 take the SIMT kernels. Sizes reach past one 128-row tile."""
import numpy as np
import pytest
import scipy.special
from hypothesis import HealthCheck, example, given, settings, strategies as st

import cuflash
from cuflash import reference
from conftest import (DTYPES, assert_close_to_reference, assert_lse_close, plain_attention,
                      plain_backward, round_to)

SMALL, LARGE = st.integers(1, 70), st.integers(129, 260)


@st.composite
def problems(draw):
    """A problem's shape, flags and seed. Sizes past one tile come with one or two heads
    in one batch, so that an emulated example stays within seconds."""
    nq, nk = draw(SMALL | LARGE), draw(SMALL | LARGE)
    small = max(nq, nk) <= 70
    return {
        "batch": draw(st.integers(1, 2)) if small else 1,
        "hkv": draw(st.integers(1, 2)) if small else 1,
        "group": draw(st.integers(1, 3 if small else 2)),
        "nq": nq, "nk": nk,
        # tensor-core head dims (multiples of 8) as often as any other
        "d": draw(st.integers(1, 72) | st.sampled_from([8, 16, 40, 64])),
        "causal": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
    }


def edge(nq, nk, d, causal, batch=1, hkv=1, group=1, seed=0):
    return example(dict(batch=batch, hkv=hkv, group=group, nq=nq, nk=nk, d=d,
                        causal=causal, seed=seed))


# The edges every run checks, whatever hypothesis draws: one query and one key, d = 1,
# rows that see no key (causal, Nq > Nk: rows 0..129 here, across a 128-row tile), and
# causal with Nq < Nk under GQA on a tensor-core head dim.
EDGES = [edge(1, 1, 8, False), edge(17, 33, 1, True, batch=2, group=2, seed=1),
         edge(150, 20, 16, True, seed=2), edge(40, 200, 64, True, group=2, seed=3)]


def with_edges(test):
    for e in EDGES:
        test = e(test)
    return test


def check_against_reference(p, dtype, backend):
    rng = np.random.default_rng(p["seed"])
    hq = p["hkv"] * p["group"]
    q = rng.standard_normal((p["batch"], hq, p["nq"], p["d"])).astype(dtype)
    k, v = (rng.standard_normal((p["batch"], p["hkv"], p["nk"], p["d"])).astype(dtype)
            for _ in range(2))
    do = rng.standard_normal(q.shape).astype(dtype)
    causal, scale = p["causal"], 1 / np.sqrt(p["d"])

    o, lse = cuflash.flash_attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype)
    assert_close_to_reference(o, ref_o, plain, dtype)
    assert_lse_close(lse, ref_lse, dtype)

    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                             backend=backend)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, causal=causal)
    plains = plain_backward(do, q, k, v, ref_o, ref_lse, causal=causal, scale=scale,
                            dtype=dtype)
    for name, g, x, r, pl in zip("qkv", grads, (q, k, v), refs, plains):
        assert g.dtype == x.dtype and g.shape == x.shape
        # plain_backward sums dk, dv over a GQA group in float64; a plain implementation
        # stores that sum in the dtype too
        assert_close_to_reference(g, r, round_to(pl, dtype), dtype, factor=3.0,
                                  what=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@with_edges
@given(problems())
def test_numpy_backend_any_shape(dtype, p):
    check_against_reference(p, dtype, "numpy")


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@with_edges
@given(problems())
def test_emulated_kernels_any_shape(dtype, p):
    check_against_reference(p, dtype, "emulator")


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.data())
def test_online_softmax_any_shape(dtype, shape, data):
    axis = data.draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1)))
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 10).astype(dtype)
    p = cuflash.online_softmax(x, axis=axis)
    assert p.dtype == x.dtype
    ref = scipy.special.softmax(x.astype(np.float64), axis=axis)
    if x.dtype == np.float64:  # a few ulps: tighter than the attention rule's fixed bound
        np.testing.assert_allclose(p, ref, rtol=1e-12, atol=1e-15)
        return
    # the plain softmax computes in float32 and stores the result in the dtype
    plain = round_to(scipy.special.softmax(x.astype(np.float32), axis=axis), dtype)
    assert_close_to_reference(p, ref, plain, dtype, what=f"softmax axis={axis}")
