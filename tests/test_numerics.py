"""Numerics at the edges: bitwise-reproducible backwards, rows that see no key, merge_states
with +inf, extreme scales and values, non-finite keys. Expectations come from the float64
references (cuflash.reference, SciPy) or from hand-worked values."""
import dataclasses
import warnings

import numpy as np
import pytest
import scipy.special

import cuflash
from cuflash import reference as R
from cuflash._dtypes import BFLOAT16
from cuflash.backends import numpy_backend as nb
from cuflash.backends.numpy_backend.config import DEFAULT_CONFIG
from cuflash.variants import Variants

from conftest import HAS_GXX

EMULATOR = pytest.param("emulator", marks=pytest.mark.skipif(not HAS_GXX,
                                                             reason="the emulator needs g++"))
BACKENDS = ["numpy", EMULATOR]


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _normal(rng, shape, dtype=np.float32, size=1.0):
    return (rng.standard_normal(shape) * size).astype(dtype)


# -- 1. the backward is bitwise reproducible ---------------------------------------------

# More workers than this machine's cores: threads interleave, as on any busy machine.
FOUR_WORKERS = nb.NumpyBackend(dataclasses.replace(DEFAULT_CONFIG, workers=4))


@pytest.mark.parametrize("B, H, Nq, Nk, causal, bias_shape", [
    (1, 4, 700, 1100, False, None),         # dQ summed over 3 K/V tiles
    (1, 2, 2048, 2048, True, None),
    (2, 16, 256, 256, False, (1, 1, 256, 256)),   # dbias summed over 32 heads' tasks
    (2, 4, 300, 1100, False, (2, 4, 300, 1)),     # and over key tiles
], ids=["plain", "causal", "bias-heads", "bias-keys"])
def test_numpy_backward_is_bitwise_reproducible(B, H, Nq, Nk, causal, bias_shape):
    rng = np.random.default_rng(1)
    q, do = (_normal(rng, (B, H, Nq, 64)) for _ in range(2))
    k, v = (_normal(rng, (B, H, Nk, 64)) for _ in range(2))
    var = None if bias_shape is None else Variants(bias=_normal(rng, bias_shape))
    o, lse = FOUR_WORKERS.forward(q, k, v, causal=causal, scale=0.125, variants=var)
    runs = [FOUR_WORKERS.backward(do, q, k, v, o, lse, causal=causal, scale=0.125,
                                  variants=var, return_dbias=var is not None)
            for _ in range(8)]
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), runs[0], run):
            assert a.tobytes() == b.tobytes(), f"{name} differs between identical calls"


# -- 2. rows whose lse is -inf contribute exactly nothing ---------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_of_rows_that_saw_no_key_is_exactly_zero(backend, causal):
    rng = np.random.default_rng(2)
    q, do = (_normal(rng, (1, 2, 24, 16)) for _ in range(2))
    k, v = (_normal(rng, (1, 2, 40, 16)) for _ in range(2))
    o = np.zeros_like(q)
    lse = np.full((1, 2, 24), -np.inf, np.float32)
    for grad in cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                 backend=backend):
        assert np.all(grad == 0)


def test_numpy_variants_backward_of_rows_that_saw_no_key_is_exactly_zero():
    rng = np.random.default_rng(3)
    q, do = (_normal(rng, (1, 2, 24, 16)) for _ in range(2))
    k, v = (_normal(rng, (1, 2, 40, 16)) for _ in range(2))
    bias = _normal(rng, (1, 2, 24, 40))
    lse = np.full((1, 2, 24), -np.inf, np.float32)
    grads = cuflash.flash_attention_backward(do, q, k, v, np.zeros_like(q), lse, bias=bias,
                                             return_dbias=True, backend="numpy")
    for grad in grads:
        assert np.all(grad == 0)


# -- 3. merge_states with lse = +inf ------------------------------------------------------

def test_merge_states_plus_inf_is_scipy_softmax():
    o = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 1, 4, 2)
    lse = np.array([[[np.inf, np.inf, 0.0, -np.inf]],
                    [[1.0, np.inf, np.inf, -np.inf]],
                    [[-np.inf, -np.inf, 2.0, -np.inf]]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        om, lm = cuflash.merge_states(o, lse)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_lse = scipy.special.logsumexp(lse.astype(np.float64), axis=0)
        assert np.isnan(scipy.special.softmax([np.inf, 1.0])).all()
    np.testing.assert_array_equal(lm, want_lse)       # +inf, +inf, +inf, -inf
    assert np.isnan(om[0, :3]).all()                  # softmax with +inf: NaN, as SciPy
    np.testing.assert_array_equal(om[0, 3], 0)        # no key in any part


# -- 4. FA1 on NumPy raises no warning ----------------------------------------------------

@pytest.mark.parametrize("case", ["huge-v", "scale-1e38", "scores-overflow", "inf-q",
                                  "causal-scores-overflow"])
def test_numpy_fa1_is_quiet_and_agrees_with_fa2(case, no_warnings):
    rng = np.random.default_rng(4)
    q, k, v = (_normal(rng, (1, 2, 40, 16)) for _ in range(3))
    kw = {"causal": case.startswith("causal")}
    if case == "huge-v":
        v = np.full_like(v, 3e38)
        v[..., 1] = -3e38
    elif case == "scale-1e38":
        q, k, kw["scale"] = q * 4, k * 1e-6, 1e38
    elif case.endswith("scores-overflow"):
        q, k = q * 1e20, k * 1e20                       # scores ±inf: rows NaN
    elif case == "inf-q":
        q[0, 0, 3, 2] = np.inf
    o1 = cuflash.flash_attention(q, k, v, algorithm="fa1", backend="numpy", **kw)
    if case.endswith("scores-overflow"):
        return                           # scores beyond float32: only quiet is promised
    o2 = cuflash.flash_attention(q, k, v, algorithm="fa2", backend="numpy", **kw)
    nan_rows = np.isnan(o1).any(axis=-1)
    np.testing.assert_array_equal(nan_rows, np.isnan(o2).any(axis=-1))
    np.testing.assert_allclose(o1[~nan_rows], o2[~nan_rows], rtol=1e-5, atol=1e-6)
    if case in ("huge-v", "scale-1e38"):
        want = R.naive_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                 scale=kw.get("scale"))
        np.testing.assert_allclose(o1, want, rtol=1e-5, atol=0)


# -- 5. extreme but representable scores and values --------------------------------------

def _scale_1e38(rng):
    """float32, scale 1e38: scores ~1e33 (representable), scale·q is not."""
    q, k, v = (_normal(rng, (1, 2, 32, 16), size=s) for s in (4.0, 1e-6, 1.0))
    return q, k, v, 1e38


def _scale_1e_300(rng):
    """float64, |q|, |k| ~ 1e200, scale 1e-300: scores ~1e100 (apart by ~1e99, far above
    their rounding), q·k is not representable."""
    q, k = (rng.choice([-1, 1], (1, 2, 32, 16)) * rng.uniform(0.5, 1, (1, 2, 32, 16)) * 1e200
            for _ in range(2))
    return q, k, rng.standard_normal((1, 2, 32, 16)), 1e-300


def _reference(q, k, v, scale, causal):
    """The float64 reference, computed where it cannot overflow: the same scores with the
    scale moved to where it fits (every factor here is a power of ten)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    qm, km = np.abs(q).max(), np.abs(k).max()
    s = scale * qm * km                               # scores = s · (q/qm)·(k/km)
    return R.naive_attention(q / qm, k / km, v, scale=s, causal=causal)


@pytest.mark.parametrize("backend", ["numpy", EMULATOR])
@pytest.mark.parametrize("make", [_scale_1e38, _scale_1e_300], ids=["1e38", "1e-300"])
@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_extreme_scale(backend, make, algorithm):
    if backend == "emulator" and make is _scale_1e_300:
        pytest.skip("kernels form q·k before the scale: |q·k| must stay below the "
                    "dtype's maximum (docs/api.md, Numerical limits)")
    rng = np.random.default_rng(5)
    q, k, v, scale = make(rng)
    with np.errstate(over="ignore", invalid="ignore"):   # the kernels' own arithmetic
        o = cuflash.flash_attention(q, k, v, scale=scale, causal=True, algorithm=algorithm,
                                    backend=backend)
    np.testing.assert_allclose(o, _reference(q, k, v, scale, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, scale, size", [(np.float32, 1e12, 1e-6),
                                                 (np.float64, 1e-300, 1e150)])
@pytest.mark.parametrize("bias", [False, True])
def test_numpy_backward_with_an_extreme_scale(dtype, scale, size, bias, no_warnings):
    """Scores of order 1 from an extreme scale (split between q and k): the gradients
    against the float64 reference backward."""
    rng = np.random.default_rng(6)
    q, k = (_normal(rng, (1, 2, 48, 16), dtype, size) for _ in range(2))
    v, do = (_normal(rng, (1, 2, 48, 16), dtype) for _ in range(2))
    b = _normal(rng, (1, 1, 48, 48), dtype) if bias else None
    o, lse = cuflash.flash_attention(q, k, v, scale=scale, causal=True, bias=b,
                                     return_lse=True, backend="numpy")
    got = cuflash.flash_attention_backward(do, q, k, v, o, lse, scale=scale, causal=True,
                                           bias=b, backend="numpy")
    want = R.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v, o, lse)),
                                scale=scale, causal=True,
                                bias=None if b is None else b.astype(np.float64))
    for g, w, x in zip(got, want, (q, k, v)):
        # dq = dS k·scale is of order size·scale, dk of order 1/size: relative to those.
        unit = np.abs(w).max()
        np.testing.assert_allclose(g / unit, w / unit, rtol=0,
                                   atol=1e-4 if dtype == np.float32 else 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_v_near_the_dtype_maximum(backend, dtype, algorithm):
    """|V| = 3e38: the output (a weighted mean of V) is representable; on NumPy it is
    right, the kernels keep it right while ℓ·max|V| stays below the float32 maximum."""
    if dtype is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(7)
    q, k = (_normal(rng, (1, 1, 64, 16), dtype) for _ in range(2))
    big = 3e38 if backend == "numpy" else 3e38 / 64 / 2   # documented limit: ℓ ≤ Nk
    v = np.full((1, 1, 64, 16), big).astype(dtype)
    v[..., 1] = rng.standard_normal(64)
    v[..., 2] = -big
    o = cuflash.flash_attention(q, k, v, algorithm=algorithm, backend=backend)
    want = R.naive_attention(*(x.astype(np.float64) for x in (q, k, v)))
    assert np.isfinite(o.astype(np.float64)).all()
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(o.astype(np.float64), want, rtol=tol, atol=tol)


# -- 6. non-finite values in keys ----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_seen_value_poisons_the_rows_that_see_it(backend):
    """Guaranteed on every backend: a NaN in v[j] makes NaN every row that sees key j
    (rows that cannot see it: docs/api.md, Numerical limits)."""
    rng = np.random.default_rng(8)
    N = 256
    q, k, v = (_normal(rng, (1, 1, N, 16)) for _ in range(3))
    v[0, 0, 200, 3] = np.nan
    o = cuflash.flash_attention(q, k, v, causal=True, backend=backend)
    assert np.isnan(o[0, 0, 200:, 3]).all()
