"""The compiled CPU kernels (numpy_backend/native): forward and backward against the
float64 reference, the same bits whatever the tasks (the forward) or for the same worker
count (the backward), and the NumPy tiles taking over what they cannot do."""
import dataclasses

import numpy as np
import pytest

from cuflash import reference as R
from cuflash._dtypes import BFLOAT16
from cuflash.backends import numpy_backend as nb
from cuflash.backends.numpy_backend import backward as bwd, forward as fwd, native
from cuflash.backends.numpy_backend.config import DEFAULT_CONFIG
from conftest import assert_close_to_reference, plain_attention
from test_numpy_backend import CASES as TILE_CASES, check_against_reference

DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 is not None else [])

CASES = TILE_CASES + [  # tiles of 96 rows, 512 keys; panels of 64 (AVX2: 16) keys
    (1, 2, 1, 500, 700, 80),      # PV columns 64 + 16 (padded from 80)
    (1, 1, 1, 300, 530, 128),
    (1, 1, 1, 97, 300, 256),
    (1, 2, 2, 40, 257, 17),
]


@pytest.fixture(params=list(native.ISAS))
def isa(request):
    """Each build this CPU runs (one it cannot is skipped, saying why)."""
    lib, why = native.library(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} build is not available: {why}")
    return request.param


def _backend(**settings):
    return nb.NumpyBackend(dataclasses.replace(DEFAULT_CONFIG, **settings))


def _qkv(rng, B, hq, hkv, Nq, Nk, d, dtype=np.float32):
    q = rng.standard_normal((B, hq, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, hkv, Nk, d)).astype(dtype)
    return q, k, v


@pytest.fixture
def tiles_forbidden(monkeypatch):
    """The NumPy tiles raise if called: the compiled kernels must have done the call."""
    def fail(*a, **kw):
        raise AssertionError("the NumPy tiles ran")
    monkeypatch.setattr(fwd, "frozen_max_tile", fail)
    monkeypatch.setattr(fwd, "online_tile", fail)
    monkeypatch.setattr(bwd, "run_tasks", fail)   # the tiles' backward; native has its own


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vs_reference(dtype, causal, isa, tiles_forbidden):
    check_against_reference(_backend(workers=2, native=isa), dtype, causal, CASES)


@pytest.mark.parametrize("causal", [False, True])
def test_peaked_scores_stay_in_the_kernel(causal, isa, tiles_forbidden):
    """Scores spread over thousands (q × 30: most weights underflow, the running max
    moves far between K/V tiles) are the kernel's to do, not the tiles' to redo."""
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 4, 2, 300, 600, 32)
    q *= 30
    o_ref, lse_ref = R.naive_attention(q, k, v, causal=causal, return_lse=True)
    o, lse = _backend(native=isa).forward(q, k, v, causal=causal, scale=32 ** -0.5)
    o_plain, _ = plain_attention(q, k, v, causal=causal, scale=32 ** -0.5, dtype=np.float32)
    assert_close_to_reference(o, o_ref, o_plain, np.float32, what="o")
    assert_close_to_reference(lse, lse_ref, None, np.float32, what="lse")


def test_one_key_far_above_the_rest(isa, tiles_forbidden):
    """One key scoring ~300 above every other, in each lane of a vector in turn: the
    row max must find it wherever it sits, or 2^(S − m) overflows. o is that key's v."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 1, 1, 20, 200, 32)
    q[:] = 1
    for key in range(17):
        kk = k.copy()
        kk[0, 0, key] = 10                           # q·k = 320 against |q·k_j| ≲ 30
        o, lse = _backend(native=isa).forward(q, kk, v, causal=False, scale=1.0)
        np.testing.assert_array_equal(o, np.broadcast_to(v[:, :, key:key + 1], o.shape))
        np.testing.assert_allclose(lse, 320, rtol=1e-6)


def test_rows_that_see_no_key(isa, tiles_forbidden):
    """Causal with Nq > Nk: the first Nq − Nk rows see no key (o = 0, lse = −inf)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 2, 1, 300, 70, 24)
    o, lse = _backend(native=isa).forward(q, k, v, causal=True, scale=0.2)
    assert np.all(o[:, :, :230] == 0) and np.all(lse[:, :, :230] == -np.inf)
    o_ref = R.naive_attention(q, k, v, causal=True, scale=0.2)
    np.testing.assert_allclose(o[:, :, 230:], o_ref[:, :, 230:], atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_same_bits_whatever_the_tasks(causal, isa, monkeypatch):
    """A row's result depends on the inputs only: not on the worker count, nor on which
    rows share its tasks and tiles (task rows not a multiple of the 96-row tile)."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 2, 700, 900, 64)
    first = _backend(workers=1, native=isa).forward(q, k, v, causal=causal, scale=0.125)
    for workers, task_rows in ((2, 384), (3, 100), (2, 1)):
        monkeypatch.setattr(native, "TASK_ROWS", task_rows)
        got = _backend(workers=workers, native=isa).forward(q, k, v, causal=causal,
                                                            scale=0.125)
        for a, b in zip(first, got):
            np.testing.assert_array_equal(a, b)


def test_not_finite_goes_to_the_tiles(isa, monkeypatch):
    """NaN or ±inf inputs, and a scaled Q, a score or P̃ V past float32, come out as the
    NumPy tiles give them (NaN in its own row, the rescues of a huge V and scale): the
    compiled kernel reports the row, and the tiles redo the call. Big but representable
    values stay with the kernel, and its result is the reference's."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 2, 1, 40, 70, 8)
    tiles = _backend(native="off")
    handed = []
    real = native.forward
    monkeypatch.setattr(native, "forward", lambda *a: handed.append(r := real(*a)) or r)
    q_nan, q_inf, k_inf, v_inf, v_max = q.copy(), q.copy(), k.copy(), v.copy(), v.copy()
    q_nan[0, 1, 5, 2] = np.nan
    q_inf[0, 0, 30] = [np.inf] + [0] * 7
    k_inf[0, 0, 50, 3] = -np.inf
    v_inf[0, 0, 10, 1] = np.inf
    v_max[..., 0] = 3e38             # P̃ V = ℓ·3e38 overflows where ℓ > 1.13
    for qq, kk, vv, scale in ((q_nan, k, v, 0.3), (q_inf, k, v, 0.3), (q, k_inf, v, 0.3),
                              (q, k, v_inf, 0.3), (q, k, v_max, 0.3),
                              (q, k, v, 1e38), (q, k * np.float32(1e20), v, 1e20)):
        with np.errstate(invalid="ignore", over="ignore"):
            want = tiles.forward(qq, kk, vv, causal=True, scale=scale)
            handed.clear()
            got = _backend(native=isa).forward(qq, kk, vv, causal=True, scale=scale)
        assert handed == [None]               # the kernel ran and declined
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
    for vv, scale in ((v, 0.3), (v * np.float32(1e30), 10.0), (v, 1e30)):   # the kernel's
        handed.clear()
        o, lse = _backend(native=isa).forward(q, k, vv, causal=True, scale=scale)
        assert handed[0] is not None
        o_ref, lse_ref = R.naive_attention(q, k, vv, causal=True, scale=scale, return_lse=True)
        np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5 * np.abs(o_ref).max())
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-4)


def test_backward_rows_that_see_no_key(isa, tiles_forbidden):
    """Causal with Nq > Nk: rows with lse = −inf add nothing, and their dq is 0."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 1, 2, 1, 300, 70, 24)
    do = rng.standard_normal(q.shape).astype(np.float32)
    bk = _backend(native=isa)
    o, lse = bk.forward(q, k, v, causal=True, scale=0.2)
    dq, dk, dv = bk.backward(do, q, k, v, o, lse, causal=True, scale=0.2)
    assert np.all(dq[:, :, :230] == 0)
    refs = R.attention_backward(do, q, k, v, o, lse, causal=True, scale=0.2)
    for g, ref in zip((dq, dk, dv), refs):
        np.testing.assert_allclose(g, ref, atol=2e-5)


def test_backward_user_lse_minus_inf(isa, monkeypatch):
    """An lse of −inf given for a row that sees keys (the tiles' rule: the row saw none)
    stays in the kernel: P = 0 there, so the row adds nothing and its dq is 0, as the
    tiles give it."""
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 1, 1, 50, 60, 16)
    do = rng.standard_normal(q.shape).astype(np.float32)
    tiles = _backend(native="off")
    o, lse = tiles.forward(q, k, v, causal=False, scale=0.25)
    lse[0, 0, 7] = -np.inf
    want = tiles.backward(do, q, k, v, o, lse, causal=False, scale=0.25)
    monkeypatch.setattr(bwd, "run_tasks", lambda *a: pytest.fail("the NumPy tiles ran"))
    got = _backend(native=isa).backward(do, q, k, v, o, lse, causal=False, scale=0.25)
    assert np.all(got[0][0, 0, 7] == 0)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_bits(causal, isa):
    """dK and dV rows are each one task's: the same bits for any worker count. dQ sums
    the tasks' terms in fixed lanes: the same bits from call to call, and from calls made
    at once from several threads, for one worker count."""
    import concurrent.futures
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 1, 4, 2, 300, 500, 40)
    do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = _backend(native=isa).forward(q, k, v, causal=causal, scale=0.15)
    one = _backend(workers=1, native=isa).backward(do, q, k, v, o, lse, causal=causal,
                                                   scale=0.15)
    two = _backend(workers=2, native=isa)
    first = two.backward(do, q, k, v, o, lse, causal=causal, scale=0.15)
    for a, b in zip(one[1:], first[1:]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(one[0], first[0], rtol=1e-5, atol=1e-6)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        again = list(pool.map(lambda _: two.backward(do, q, k, v, o, lse, causal=causal,
                                                     scale=0.15), range(3)))
    for got in again:
        for a, b in zip(first, got):
            np.testing.assert_array_equal(a, b)


def test_backward_not_finite_goes_to_the_tiles(isa, monkeypatch):
    """A NaN in Q, or an lse that is not the forward's (P past float32): the tiles redo
    the backward and give their own result, bit for bit."""
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 1, 2, 1, 40, 70, 8)
    do = rng.standard_normal(q.shape).astype(np.float32)
    tiles = _backend(native="off")
    o, lse = tiles.forward(q, k, v, causal=True, scale=0.3)
    handed = []
    real = native.backward
    monkeypatch.setattr(native, "backward", lambda *a: handed.append(r := real(*a)) or r)
    q_nan = q.copy()
    q_nan[0, 1, 5, 2] = np.nan
    lse_low = lse - 200                      # P = e^200 overflows float32
    for qq, ll in ((q_nan, lse), (q, lse_low)):
        with np.errstate(invalid="ignore", over="ignore"):
            want = tiles.backward(do, qq, k, v, o, ll, causal=True, scale=0.3)
            handed.clear()
            got = _backend(native=isa).backward(do, qq, k, v, o, ll, causal=True, scale=0.3)
        assert handed == [None]
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


def test_not_available_goes_to_the_tiles(monkeypatch):
    """No library (no AVX2, no compiler): the NumPy tiles, with the same results."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 2, 2, 100, 100, 16)
    want = _backend(native="off").forward(q, k, v, causal=False, scale=0.25)
    monkeypatch.setattr(native, "library", lambda isa: (None, "planted"))
    got = _backend().forward(q, k, v, causal=False, scale=0.25)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    """A compiler that fails leaves no library in the cache and says what it ran; a
    cache that cannot be written, or no compiler, is said too."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "numpy_dispatch", lambda: (None, {"AVX2": True, "FMA3": True}))
    monkeypatch.setenv("CXX", "false")
    native._library.cache_clear()
    try:
        lib, why = native.library("avx2")
        assert lib is None and "failed on the CPU kernels (avx2)" in why
        assert not list((tmp_path / "cpu").glob("*.so"))
        monkeypatch.setenv("CXX", "g++")
        blocked = tmp_path / "file"
        blocked.write_text("")                   # the cache's folder cannot be made
        monkeypatch.setenv("CUFLASH_CACHE_DIR", str(blocked))
        native._library.cache_clear()
        lib, why = native.library("avx2")
        assert lib is None and why.startswith(f"could not build into {blocked / 'cpu'}: ")
        monkeypatch.setenv("CXX", "no-such-compiler")
        native._library.cache_clear()
        assert native.library() == (None, "no C++ compiler ('no-such-compiler' is not on PATH)")
    finally:
        native._library.cache_clear()


def test_the_widest_build_this_cpu_runs(monkeypatch):
    """"auto" is AVX-512 where NumPy reads AVX512F, else AVX2 with FMA, else none; a
    build asked for by name says which feature it misses."""
    native._library.cache_clear()
    try:
        for features, best in (({"AVX512F": True, "AVX2": True, "FMA3": True}, "avx512"),
                               ({"AVX512F": False, "AVX2": True, "FMA3": True}, "avx2"),
                               ({"AVX2": True}, None), ({}, None)):
            monkeypatch.setattr(native, "numpy_dispatch", lambda f=features: (None, f))
            assert native.best_isa() == best
        assert native.library() == (None, "this CPU has neither AVX-512F nor AVX2 with FMA")
        assert native.library("avx512") == (None, "this CPU has no AVX512F or FMA3 "
                                                  "(needed by avx512)")
    finally:
        native._library.cache_clear()


def test_float64_keeps_the_tiles(monkeypatch):
    """The compiled kernels are float32: float64 calls never reach them."""
    monkeypatch.setattr(native, "forward", lambda *a: pytest.fail("native.forward called"))
    monkeypatch.setattr(native, "backward", lambda *a: pytest.fail("native.backward called"))
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 1, 1, 20, 20, 8, np.float64)
    o, lse = _backend().forward(q, k, v, causal=False, scale=0.3)
    np.testing.assert_allclose(o, R.naive_attention(q, k, v, scale=0.3), atol=1e-13)
    dq, _, _ = _backend().backward(np.ones_like(q), q, k, v, o, lse, causal=False, scale=0.3)
    ref = R.attention_backward(np.ones_like(q), q, k, v, o, lse, causal=False, scale=0.3)[0]
    np.testing.assert_allclose(dq, ref, atol=1e-12)
