"""The NumPy backend, called directly with 4-D inputs, against the float64 references."""
import dataclasses
import math
import os
import threading
import tracemalloc

import numpy as np
import pytest
import scipy.special

from cuflash import reference as R
from cuflash._dtypes import BFLOAT16, accum_dtype
from cuflash.backends import numpy_backend as nb
from cuflash.backends.numpy_backend import forward as fwd
from cuflash.backends.numpy_backend.config import DEFAULT_CONFIG, CpuConfig
from cuflash.backends.numpy_backend.expbase import BASE_2, BASE_E, exp_limit, fastest_base
from cuflash.backends.numpy_backend.schedule import block_schedule, mask_block
from conftest import (assert_close_to_reference, plain_attention, plain_backward,
                      round_to)

BK = nb.BACKEND
DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
if BFLOAT16 is not None:
    DTYPES.insert(1, BFLOAT16)


SMALL_TILES = dataclasses.replace(  # modest sizes walk through many Q and K/V tiles
    DEFAULT_CONFIG, rows=16, causal_rows=16, block_n=24, bwd_rows=16, bwd_block_n=24,
    diag_keys=5,    # diagonal strips: 16 = 5 + 5 + 5 + 1
    bwd_diag=7,     # 24 = 7 + 7 + 7 + 3
    tile_budget=16 * 24 * 2 * 8 * 64, bwd_tile_budget=16 * 24 * 2,   # 2 heads up to d = 64
    max_sample=5,   # the frozen max from part of a tile
    native="off")   # the NumPy tiles (tests/test_native_kernels.py: the compiled kernels)


def _backend(config=SMALL_TILES, **settings):
    return nb.NumpyBackend(dataclasses.replace(config, **settings))


@pytest.fixture(params=[BASE_2, BASE_E], ids=lambda b: f"base{b.name}")
def exp_base(request):
    """Both exponential bases, whichever this CPU's NumPy makes the default."""
    return request.param


def _scale(q):
    return 1 / math.sqrt(q.shape[-1])


def _qkv(rng, B, hq, hkv, Nq, Nk, d, dtype=np.float64):
    q = rng.standard_normal((B, hq, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, hkv, Nk, d)).astype(dtype)
    return q, k, v


CASES = [  # B, Hq, Hkv, Nq, Nk, d
    (1, 1, 1, 1, 1, 1),
    (2, 2, 2, 17, 17, 32),
    (1, 4, 2, 113, 203, 59),
    (1, 3, 1, 203, 113, 64),
    (2, 2, 1, 1, 113, 8),
    (1, 2, 2, 203, 1, 16),
]


def check_against_reference(bk, dtype, causal, cases):
    """bk's forward and backward on each of `cases` (B, Hq, Hkv, Nq, Nk, d) in `dtype`,
    within the float64 reference's error bound for `dtype`."""
    rng = np.random.default_rng(0)
    for B, hq, hkv, Nq, Nk, d in cases:
        q, k, v = _qkv(rng, B, hq, hkv, Nq, Nk, d, dtype)
        scale = 1 / math.sqrt(d)
        o_ref, lse_ref = R.naive_attention(q, k, v, causal=causal, return_lse=True)
        o, lse = bk.forward(q, k, v, causal=causal, scale=scale, algorithm="fa2")
        assert o.dtype == dtype and o.shape == q.shape
        assert lse.dtype == accum_dtype(dtype) and lse.shape == q.shape[:3]
        case = f"{dtype} {(B, hq, hkv, Nq, Nk, d)}"
        o_plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype)
        assert_close_to_reference(o, o_ref, o_plain, dtype, what="o " + case)
        # lse is computed in the accumulation dtype for every input dtype: its rule
        assert_close_to_reference(lse, lse_ref, None, accum_dtype(dtype), what="lse " + case)
        assert not np.isnan(o.astype(np.float64)).any()

        do = rng.standard_normal(q.shape).astype(dtype)
        grads = bk.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        refs = R.attention_backward(do, q, k, v, o, lse, causal=causal)
        plains = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=dtype)
        for name, g, x, ref, plain in zip("qkv", grads, (q, k, v), refs, plains):
            assert g.dtype == dtype and g.shape == x.shape
            assert_close_to_reference(g, ref, plain, dtype, factor=3.0, what=f"d{name} " + case)


@pytest.mark.parametrize("fast", [True, False], ids=["frozen", "online"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward_vs_reference(dtype, causal, fast, exp_base):
    check_against_reference(_backend(base=exp_base, frozen_max=fast), dtype, causal, CASES)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fa1_agrees_with_fa2(dtype, causal):
    bk = _backend()
    rng = np.random.default_rng(1)
    for B, hq, hkv, Nq, Nk, d in CASES:
        q, k, v = _qkv(rng, B, hq, hkv, Nq, Nk, d, dtype)
        o1, lse1 = bk.forward(q, k, v, causal=causal, scale=0.5, algorithm="fa1")
        o2, lse2 = bk.forward(q, k, v, causal=causal, scale=0.5, algorithm="fa2")
        tol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(o1, o2, rtol=tol, atol=tol)
        np.testing.assert_allclose(lse1, lse2, rtol=tol, atol=tol)
        assert o1.dtype == o2.dtype and lse1.dtype == lse2.dtype


def test_default_tiles_and_threads():
    """Real tile sizes, several tiles each way, one and several workers."""
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 4, 2, 700, 1100, 64, np.float64)
    do = rng.standard_normal(q.shape)
    o_ref, lse_ref = R.naive_attention(q, k, v, causal=True, return_lse=True)
    g_ref = R.attention_backward(do, q, k, v, o_ref, lse_ref, causal=True)
    for threads in (1, 2, 3):
        bk = _backend(DEFAULT_CONFIG, workers=threads)
        o, lse = bk.forward(q, k, v, causal=True, scale=_scale(q))
        np.testing.assert_allclose(o, o_ref, atol=1e-12)
        np.testing.assert_allclose(lse, lse_ref, atol=1e-12)
        for g, r in zip(bk.backward(do, q, k, v, o, lse, causal=True, scale=_scale(q)), g_ref):
            np.testing.assert_allclose(g, r, atol=1e-11)


def test_strided_inputs():
    bk = _backend()
    rng = np.random.default_rng(3)
    base = rng.standard_normal((2, 40, 3, 9)).astype(np.float32)
    q = base.transpose(0, 2, 1, 3)[:, :, ::2, :8]        # (2, 3, 20, 8), odd strides
    k = rng.standard_normal((2, 8, 1, 30)).astype(np.float32).transpose(0, 2, 3, 1)
    v = np.asfortranarray(rng.standard_normal((2, 1, 30, 8)).astype(np.float32))
    o, lse = bk.forward(q, k, v, causal=True, scale=_scale(q))
    np.testing.assert_allclose(o, R.naive_attention(q, k, v, causal=True), atol=2e-6)
    do = np.ones_like(q)
    ref = R.attention_backward(do, q, k, v, o, lse, causal=True)
    for g, r in zip(bk.backward(do, q, k, v, o, lse, causal=True, scale=_scale(q)), ref):
        np.testing.assert_allclose(g, r, atol=2e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_fully_masked_rows(fast, exp_base):
    bk = _backend(base=exp_base, frozen_max=fast)
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 2, 1, 50, 7, 4, np.float32)     # Nq > Nk: 43 rows see nothing
    o, lse = bk.forward(q, k, v, causal=True, scale=_scale(q))
    assert np.all(o[:, :, :43] == 0) and np.all(lse[:, :, :43] == -np.inf)
    assert np.isfinite(o).all() and np.isfinite(lse[:, :, 43:]).all()
    dq, dk, dv = bk.backward(np.ones_like(q), q, k, v, o, lse, causal=True, scale=_scale(q))
    assert np.all(dq[:, :, :43] == 0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.mark.parametrize("fast", [True, False])
def test_nan_and_inf_stay_in_their_row(fast, exp_base):
    bk = _backend(base=exp_base, frozen_max=fast)
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 1, 1, 40, 60, 4, np.float32)
    q[0, 0, 3, 1] = np.nan          # NaN scores in row 3
    q[0, 0, 30] = [np.inf, 0, 0, 0]  # ±inf scores in row 30: exp(inf − inf) = NaN, as scipy
    with np.errstate(invalid="ignore"):
        o_ref = R.naive_attention(q, k, v)
        o, lse = bk.forward(q, k, v, causal=False, scale=_scale(q))
    bad = np.isnan(o_ref)
    assert bad[0, 0, 3].all() and bad[0, 0, 30].all()
    np.testing.assert_array_equal(np.isnan(o), bad)
    np.testing.assert_allclose(o[~bad], o_ref[~bad], atol=1e-6)
    assert np.isnan(lse[0, 0, [3, 30]]).all() and np.isfinite(np.delete(lse, [3, 30])).all()


def test_large_scores_fall_back_to_running_max(exp_base):
    """Scores far outside exp's range: the frozen-max path must hand over, exactly."""
    bk = _backend(base=exp_base)
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 1, 2, 2, 40, 70, 8, np.float32)
    k_grow = k.copy()
    k_grow[:, :, 30:] *= 40          # scores jump after the first K tile: exp overflows
    v_huge = v * np.float32(1e30)     # P̃ V overflows although ℓ does not
    for kk, vv, scale in ((k, v, 300.0), (k, v, -300.0), (k, v, 1e-30),
                          (k_grow, v, None), (k, v_huge, 10.0)):
        o_ref, lse_ref = R.naive_attention(q, kk, vv, causal=True, scale=scale, return_lse=True)
        o, lse = bk.forward(q, kk, vv, causal=True, scale=_scale(q) if scale is None else scale)
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4 * np.abs(o_ref).max())
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-3)
    # scores of −200: exp underflows to 0 although the row has keys
    q2, k2 = np.full((1, 1, 3, 1), 1.0, np.float32), np.full((1, 1, 5, 1), -200.0, np.float32)
    v2 = rng.standard_normal((1, 1, 5, 1)).astype(np.float32)
    o, lse = bk.forward(q2, k2, v2, causal=False, scale=1.0)
    np.testing.assert_allclose(o, R.naive_attention(q2, k2, v2, scale=1.0), rtol=1e-6)
    np.testing.assert_allclose(lse, -200 + np.log(5), rtol=1e-6)


def _count_online_tiles(monkeypatch):
    """A list that gets one entry per online_tile call the forward makes."""
    calls = []
    online = fwd.online_tile
    monkeypatch.setattr(fwd, "online_tile", lambda *a, **kw: calls.append(1) or online(*a, **kw))
    return calls


def test_frozen_max_hands_over(monkeypatch):
    """The fast path really declines a tile whose scores outgrow its first K tile."""
    bk = _backend()
    calls = _count_online_tiles(monkeypatch)
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 1, 1, 1, 16, 48, 4, np.float32)
    bk.forward(q, k, v, causal=False, scale=_scale(q))
    assert not calls
    _backend(frozen_max=False, workers=1).forward(q, k, v, causal=False, scale=_scale(q))
    assert len(calls) == 1  # the one tile, with the running max from the start
    calls.clear()
    k[:, :, 30:] *= 100
    o, _ = bk.forward(q, k, v, causal=False, scale=_scale(q))
    assert calls
    np.testing.assert_allclose(o, R.naive_attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_failed_reference_hands_over_at_once(monkeypatch):
    """A frozen reference that fails at a step (ℓ past 2^64: ℓ only grows) hands the tile
    to the running max there, not after its last step: one Q tile, four K/V steps, scores
    100× larger from the second — two frozen steps, then four running-max ones."""
    from cuflash.backends.numpy_backend import forward_tiles
    steps = []
    scores = forward_tiles._scores
    monkeypatch.setattr(forward_tiles, "_scores", lambda *a: steps.append(1) or scores(*a))
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 1, 1, 1, 16, 96, 4, np.float32)
    k[:, :, 24:] *= 100
    o, _ = _backend(workers=1).forward(q, k, v, causal=False, scale=_scale(q))
    assert len(steps) == 2 + 4
    np.testing.assert_allclose(o, R.naive_attention(q, k, v), rtol=1e-4, atol=1e-5)


def _prepare_all(q4, *args):
    """forward.prepare's arrays with every head filled."""
    arrays, prepare_heads = fwd.prepare(q4, *args)
    prepare_heads((0, q4.shape[0]))
    return arrays


def test_exp_range_bound(exp_base):
    """in_range promises |S_b − m_b| within BASE.exp's fast range, from norms alone."""
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 1, 4, 2, 300, 200, 16, np.float32)
    f32 = np.dtype(np.float32)
    q4, k3, v3 = q.reshape(2, 2, 300, 16), k.reshape(2, 200, 16), v.reshape(2, 200, 16)
    config = dataclasses.replace(DEFAULT_CONFIG, base=exp_base)
    for scale, causal in ((0.25, False), (0.25, True)):
        Qx, Kx, Vx, m, in_range = _prepare_all(q4, k3, v3, scale, causal, f32, config)
        assert in_range.all()
        S_b = Qx @ Kx.transpose(0, 2, 1)[:, None]       # S_b − m_b for every (row, key)
        assert np.abs(S_b).max() <= exp_limit(f32, exp_base)
        np.testing.assert_allclose(-Qx[..., -1] * exp_base.ln, m, rtol=1e-6)
    k3_big = k3.copy()
    k3_big[1] *= 100                                     # |c·q||k| past the limit, head 1 only
    *_, in_range = _prepare_all(q4, k3_big, v3, 0.25, False, f32, config)
    assert in_range.tolist() == [True, False]
    q4_nan = q4.copy()
    q4_nan[0, 1, 7, 3] = np.nan
    *_, in_range = _prepare_all(q4_nan, k3, v3, 0.25, False, f32, config)
    assert in_range.tolist() == [False, True]


@pytest.mark.parametrize("causal", [False, True])
def test_clipped_exp_keeps_the_fast_path(causal, exp_base, monkeypatch):
    """Scores far below the row max (weights < 2^-100) are clipped, not sent to the
    slow path: the frozen max still serves and the result is the reference's."""
    bk = _backend(base=exp_base)
    calls = _count_online_tiles(monkeypatch)
    rng = np.random.default_rng(11)
    q = np.abs(rng.standard_normal((1, 2, 40, 8))).astype(np.float32)
    k = rng.standard_normal((1, 2, 60, 8)).astype(np.float32) * 10
    k[:, :, 0] = 100          # key 0 (sampled, seen by every row) scores highest everywhere
    v = rng.standard_normal((1, 2, 60, 8)).astype(np.float32)
    *_, in_range = _prepare_all(q.reshape(2, 1, 40, 8), k.reshape(2, 60, 8),
                               v.reshape(2, 60, 8), 1.0, causal, np.dtype(np.float32),
                               bk.config)
    assert not in_range.any()
    o_ref, lse_ref = R.naive_attention(q.astype(np.float64), k, v, causal=causal, scale=1.0,
                                       return_lse=True)
    o, lse = bk.forward(q, k, v, causal=causal, scale=1.0)
    assert not calls
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_peaked_scores(causal, exp_base):
    """Scores spread over thousands (q × 30): most weights underflow. Forward (frozen
    max declined, running max clipped) and backward (clipped) match the reference."""
    bk = _backend(base=exp_base)
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, 1, 4, 2, 70, 90, 16, np.float32)
    q *= 30
    *_, in_range = _prepare_all(q.reshape(2, 2, 70, 16), k.reshape(2, 90, 16),
                               v.reshape(2, 90, 16), 0.25, causal, np.dtype(np.float32),
                               bk.config)
    assert not in_range.any()   # the clipped exponential path
    do = rng.standard_normal(q.shape).astype(np.float32)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    o_ref, lse_ref = R.naive_attention(q64, k64, v64, causal=causal, return_lse=True)
    o, lse = bk.forward(q, k, v, causal=causal, scale=_scale(q))
    assert_close_to_reference(o, o_ref, None, np.float32)
    assert_close_to_reference(lse, lse_ref, None, np.float32, what="lse")
    grads = bk.backward(do, q, k, v, o, lse, causal=causal, scale=_scale(q))
    refs = R.attention_backward(do64, q64, k64, v64, o_ref, lse_ref, causal=causal)
    for name, g, r in zip("qkv", grads, refs):
        assert_close_to_reference(g, r, None, np.float32, factor=3.0, what=f"d{name}")


def _coverage(Nq, Nk, Br, Bc, causal, outer, diag):
    """How often block_schedule computes each (query, key) pair unmasked / masked."""
    seen = np.zeros((Nq, Nk), int)
    masked = np.zeros((Nq, Nk), int)
    for a0, a1, steps in block_schedule(Nq, Nk, Br, Bc, causal=causal, outer=outer,
                                        diag=diag):
        for r0, r1, c0, c1, t in steps:
            assert r1 > r0 and c1 > c0
            assert (a0 <= r0 < r1 <= a1) if outer == "q" else (a0 <= c0 < c1 <= a1)
            S = np.zeros((1, r1 - r0, c1 - c0))
            if t is not None:
                mask_block(S, 1, r1 - r0, t)
            hidden = S[0] == -np.inf
            # No key (outer="q") / no row (outer="k") of a block is hidden throughout it.
            assert not hidden.all(axis=0 if outer == "q" else 1).any()
            seen[r0:r1, c0:c1] += ~hidden
            masked[r0:r1, c0:c1] += hidden
    return seen, masked


@pytest.mark.parametrize("outer", ["q", "k"])
@pytest.mark.parametrize("shape", [(64, 64, 8, 16), (50, 70, 16, 8), (100, 10, 16, 8),
                                   (10, 100, 3, 7), (1, 33, 4, 4), (33, 1, 4, 4),
                                   (300, 300, 64, 48), (77, 300, 32, 64)])
@pytest.mark.parametrize("diag", [None, 1, 5, 16])
def test_schedule_covers_exactly_the_visible_keys(shape, outer, diag):
    """Every visible (query, key) pair is computed once and unmasked; no hidden pair
    escapes the mask (checked with mask_block itself, the code the loops run)."""
    Nq, Nk, Br, Bc = shape
    for causal in (False, True):
        visible = ~R.causal_mask(Nq, Nk) if causal else np.ones((Nq, Nk), bool)
        seen, masked = _coverage(Nq, Nk, Br, Bc, causal, outer, diag)
        np.testing.assert_array_equal(seen, visible)
        assert causal or not masked.any()


def test_causal_schedule_skips_blocks():
    N = 2048
    # Forward, 512-row Q tiles: unmasked full-height blocks below the diagonal, and
    # the 512 × 512 triangle on it cut into 128-key strips, each computing only
    # the rows that see its keys: 4 + 3 + 2 + 1 of the triangle's 16 128² blocks.
    # Computed: 53% of N² (the whole triangle, as before: 62.5%).
    sched = list(block_schedule(N, N, 512, 512, causal=True, diag=128))
    blocks = [b for r0, r1, kv in sched for b in kv]
    diag = [b for b in blocks if b[4] is not None]
    assert len(diag) == 16 and all(c1 - c0 == 128 and a0 == c0 and a1 == c0 // 512 * 512 + 512
                                   and t == 0 for a0, a1, c0, c1, t in diag)
    assert all(a1 - a0 == 512 and c1 - c0 == 512 for a0, a1, c0, c1, t in blocks if t is None)
    total = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1, t in blocks)
    assert total == 128 * 128 * 136 and total / N**2 < 0.54   # (1 + 2 + … + 16) 128² blocks
    # Backward, 512-key tiles cut into 128-key strips on the diagonal: the mirror image.
    sched = list(block_schedule(N, N, 256, 512, causal=True, outer="k", diag=128))
    blocks = [b for c0, c1, qt in sched for b in qt]
    assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1, t in blocks) == total
    assert sum(t is not None for *_, t in blocks) == 16
    # Nq > Nk: the first Q tiles see no key at all and visit nothing.
    sched = list(block_schedule(100, 10, 16, 8, causal=True))
    assert [len(kv) for *_, kv in sched][:5] == [0, 0, 0, 0, 0]
    assert all(t is None for *_, kv in block_schedule(50, 70, 16, 8, causal=False)
               for *_, t in kv)


@pytest.mark.parametrize("native", ["auto", "off"])
def test_forward_memory_is_linear(native):
    """One head, N = 16384, d = 64, float32: the N×N scores would be 1 GiB."""
    bk = _backend(DEFAULT_CONFIG, native=native)
    rng = np.random.default_rng(7)
    N, d = 16384, 64
    q, k, v = _qkv(rng, 1, 1, 1, N, N, d, np.float32)
    nb.release_buffers()   # buffers kept from earlier tests would not count
    tracemalloc.start()
    try:
        o, lse = bk.forward(q, k, v, causal=True, scale=_scale(q))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    for i in (0, 5000, N - 1):  # spot-check rows: causal row i sees keys 0..i
        ref = R.naive_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1])
        np.testing.assert_allclose(o[:, :, i:i + 1], ref, atol=2e-6)


# ---------------------------------------------------------------- kept buffers
def _kept():
    from cuflash.backends.numpy_backend.arrays import CALL_BUFFERS
    return CALL_BUFFERS


@pytest.mark.parametrize("causal", [False, True])
def test_kept_buffers_carry_nothing_between_calls(causal, monkeypatch):
    """The prepared copies of a call land on buffers kept from earlier calls; whatever an
    earlier call left there (here NaN in every byte) must not reach the result."""
    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, 2, 4, 2, 150, 170, 24, np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    bk = _backend(SMALL_TILES, workers=2)
    o, lse = bk.forward(q, k, v, causal=causal, scale=_scale(q))
    grads = bk.backward(do, q, k, v, o, lse, causal=causal, scale=_scale(q))
    kept = list(_kept()._free)
    assert kept
    for buf in kept:
        buf.fill(0xFF)                                  # NaN in float32 and float64
    handed = []
    real = fwd.prepare
    monkeypatch.setattr(fwd, "prepare", lambda *a: handed.append(a[-1]) or real(*a))
    o2, lse2 = bk.forward(q, k, v, causal=causal, scale=_scale(q))
    grads2 = bk.backward(do, q, k, v, o2, lse2, causal=causal, scale=_scale(q))
    assert any(np.shares_memory(handed[0][0], buf) for buf in kept)   # it was reused
    for a, b in zip((o, lse, *grads), (o2, lse2, *grads2)):
        np.testing.assert_array_equal(a, b)


def test_kept_buffers_one_per_call():
    """Buffers a call holds are never handed to another; one given back is, the smallest
    that fits first; one past the limit, or never given back, is not kept."""
    from cuflash.backends.numpy_backend.arrays import Reused
    kept = Reused(4096)
    b1, (x, n) = kept.take(((10, 3), np.float32), ((5,), np.int64))
    assert (x.shape, x.dtype, n.shape, n.dtype) == ((10, 3), np.float32, (5,), np.int64)
    assert not np.shares_memory(x, n) and x.flags.c_contiguous
    b2, _ = kept.take(((100,), np.float64))
    assert b2 is not b1 and not np.shares_memory(b1, b2)
    kept.give_back(b2)
    kept.give_back(b1)
    assert kept.take(((4,), np.float32))[0] is b1        # the smaller of the two that fit
    assert kept.take(((4,), np.float32))[0] is b2
    b3, _ = kept.take(((4,), np.float32))
    assert b3 is not b1 and b3 is not b2
    big, _ = kept.take(((2048,), np.float32))            # 8 KiB: past the limit
    kept.give_back(big)
    assert not kept._free


def test_failed_call_keeps_no_buffer(monkeypatch):
    """A call that fails may leave pool tasks writing into its buffer: it is not kept."""
    rng = np.random.default_rng(22)
    q, k, v = _qkv(rng, 1, 2, 2, 64, 64, 8, np.float32)
    bk = _backend(workers=2)
    taken = []
    real = _kept().take

    def take(*specs):
        buf, arrays = real(*specs)
        taken.append(buf)
        return buf, arrays

    def fail(*a, **kw):
        raise MemoryError("planted")
    monkeypatch.setattr(_kept(), "take", take)
    monkeypatch.setattr(fwd, "frozen_max_tile", fail)
    with pytest.raises(MemoryError, match="planted"):
        bk.forward(q, k, v, causal=False, scale=0.5)
    assert taken and not any(buf is taken[0] for buf in _kept()._free)


def test_release_buffers_frees_what_calls_kept():
    """After release_buffers a call allocates its buffers afresh (tracemalloc sees them)."""
    rng = np.random.default_rng(24)
    q, k, v = _qkv(rng, 1, 2, 2, 512, 512, 32, np.float32)
    bk = _backend(DEFAULT_CONFIG, native="off")

    def peak():
        tracemalloc.start()
        try:
            bk.forward(q, k, v, causal=False, scale=0.2)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    bk.forward(q, k, v, causal=False, scale=0.2)
    kept = peak()
    nb.release_buffers()
    assert not _kept()._free
    fresh = peak()
    prepared = 3 * 2 * 512 * 33 * 4                     # [Q | ·], [K | 1], [V | 1]
    assert fresh - kept >= prepared, (fresh, kept)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_kept_buffers_after_fork():
    """A process forked while another thread held the buffers' lock can still take one."""
    import signal
    import time
    held, release = threading.Event(), threading.Event()

    def hold():
        with _kept()._lock:
            held.set()
            release.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:                                    # the child: take, then leave
            code = 1
            try:
                _kept().take(((4,), np.float32))
                code = 0
            finally:
                os._exit(code)
        for _ in range(200):                            # 10 s at most
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the kept buffers' lock")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join()


@pytest.mark.parametrize("causal", [False, True])
def test_concurrent_calls(causal):
    """Calls from several threads at once each get their own buffers and results."""
    import concurrent.futures
    rng = np.random.default_rng(23)
    inputs = [_qkv(rng, 1, 4, 2, 200, 200, 16, np.float32) for _ in range(4)]
    bk = _backend(SMALL_TILES, workers=2)

    def both(qkv):
        o, lse = bk.forward(*qkv, causal=causal, scale=0.3)
        return o, lse, *bk.backward(np.ones_like(qkv[0]), *qkv, o, lse, causal=causal, scale=0.3)
    alone = [both(x) for x in inputs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(both, inputs * 3))
    for i, got in enumerate(together):
        for a, b in zip(alone[i % 4], got):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- the pool and BLAS
def _blas_threads():
    from threadpoolctl import threadpool_info
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_blas_one_thread_during_the_tasks_only():
    """The tasks run with every BLAS at one thread (the threads split the cores already);
    a user's own BLAS calls before and after keep the count they had."""
    from threadpoolctl import threadpool_limits
    from cuflash.backends.numpy_backend import pool
    if not _blas_threads():
        pytest.skip("NumPy's BLAS is not one threadpoolctl knows")
    rng = np.random.default_rng(29)
    q, k, v = _qkv(rng, 1, 2, 2, 64, 64, 16, np.float32)
    with threadpool_limits(3, user_api="blas"):         # more than one, on any machine
        assert set(_blas_threads()) == {3}
        during = pool.run_tasks(lambda task: _blas_threads(), range(4), 2)
        assert during == [[1] * len(_blas_threads())] * 4
        o, lse = BK.forward(q, k, v, causal=False, scale=0.3)
        BK.backward(np.ones_like(q), q, k, v, o, lse, causal=False, scale=0.3)
        assert set(_blas_threads()) == {3}


def test_blas_count_restored_after_concurrent_calls_and_errors():
    """Calls from several threads at once, none of them the thread that set the user's
    limit, share one lowering; the last one out restores the count, also when a task
    raises."""
    import concurrent.futures
    from threadpoolctl import threadpool_limits
    from cuflash.backends.numpy_backend import pool
    if not _blas_threads():
        pytest.skip("NumPy's BLAS is not one threadpoolctl knows")
    started = threading.Barrier(3)
    during = []

    def task(i):
        if i == 0:
            started.wait(10)                              # three calls inside at once
            during.append(_blas_threads())
        if i == 1:
            raise ZeroDivisionError("planted")
        return i

    def call(_):
        try:
            pool.run_tasks(task, range(3), 2)
        except ZeroDivisionError:
            return "raised"
    with threadpool_limits(3, user_api="blas"):          # this thread's limit
        with concurrent.futures.ThreadPoolExecutor(3) as threads:
            assert list(threads.map(call, range(3))) == ["raised"] * 3
        assert during == [[1] * len(_blas_threads())] * 3
        assert set(_blas_threads()) == {3}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_blas_count_restored_in_a_child_forked_during_a_call():
    """A child forked while a call holds BLAS at one thread has none of the call, so it
    gets the counts back."""
    from threadpoolctl import threadpool_limits
    from cuflash.backends.numpy_backend import pool
    if not _blas_threads():
        pytest.skip("NumPy's BLAS is not one threadpoolctl knows")
    with threadpool_limits(3, user_api="blas"):
        with pool.ONE_BLAS_THREAD:
            assert set(_blas_threads()) == {1}
            pid = os.fork()
            if pid == 0:
                os._exit(0 if set(_blas_threads()) == {3} else 1)
            _, status = os.waitpid(pid, 0)
            assert set(_blas_threads()) == {1}              # the parent's call goes on
        assert os.waitstatus_to_exitcode(status) == 0


def test_run_tasks_returns_after_every_task():
    """Results in task order, each task run once; a task that raises stops the others
    taking new ones, and the error comes out only after the running ones have ended
    (so none still writes into a failed call's arrays)."""
    import time
    from cuflash.backends.numpy_backend import pool
    ran = []
    assert pool.run_tasks(lambda t: ran.append(t) or t * t, range(9), 3) == [t * t for t in range(9)]
    assert sorted(ran) == list(range(9))
    ended = []

    caller = threading.current_thread()

    def task(i):
        if i < 2 and threading.current_thread() is caller:
            time.sleep(0.05)                              # the helper has the other one
            raise ValueError("planted")
        if i < 2:
            time.sleep(0.3)                               # still running when the caller raises
        ended.append(i)
        return i
    with pytest.raises(ValueError, match="planted"):
        pool.run_tasks(task, range(50), 2)
    assert len(ended) == 1 and ended[0] < 2


def test_once_per_head_range():
    """The forward's tasks prepare their heads through pool.Once: one run per item
    whatever the number of tasks asking at once, and none of them goes on before it
    has ended; a run that raised is redone by the next asker."""
    import time
    from cuflash.backends.numpy_backend import pool
    runs, ended = [], []

    def prepare(item):
        runs.append(item)
        if item == "bad" and runs.count("bad") == 1:
            raise RuntimeError("planted")
        time.sleep(0.05)
        ended.append(item)
    once = pool.Once(prepare)

    def task(i):
        once(("a", "b")[i % 2])
        return ("a", "b")[i % 2] in ended             # its item's run has ended
    assert all(pool.run_tasks(task, range(8), 4))
    assert sorted(runs) == ["a", "b"]
    with pytest.raises(RuntimeError, match="planted"):
        once("bad")
    once("bad")
    once("bad")
    assert runs.count("bad") == 2 and ended.count("bad") == 1


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("block", [1, 7, 1 << 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_vs_scipy(dtype, block):
    bk = _backend(DEFAULT_CONFIG, softmax_block=block)
    rng = np.random.default_rng(8)
    for shape in [(1, 1, 1), (3, 17, 5), (2, 113, 1), (1, 203, 4)]:
        x = (rng.standard_normal(shape) * 10).astype(dtype)
        p = bk.softmax(x)
        assert p.dtype == dtype and p.shape == shape
        ref = scipy.special.softmax(x.astype(np.float64), axis=1)
        if dtype.itemsize >= 4:  # a few ulps: tighter than the attention rule's fixed bound
            tol = {8: 1e-13, 4: 1e-6}[dtype.itemsize]
            np.testing.assert_allclose(p.astype(np.float64), ref, rtol=tol, atol=tol)
            continue
        # 16-bit: the plain softmax computes in float32 and stores the result in the dtype
        plain = round_to(scipy.special.softmax(x.astype(np.float32), axis=1), dtype)
        assert_close_to_reference(p, ref, plain, dtype, what=f"softmax {shape}")


@pytest.mark.parametrize("block", [1, 2, 1 << 16])
def test_softmax_nan_inf_like_scipy(block):
    bk = _backend(DEFAULT_CONFIG, softmax_block=block)
    x = np.array([[-np.inf, -np.inf, -np.inf, -np.inf],
                  [-np.inf, -np.inf, 1.0, 2.0],
                  [np.inf, 1.0, 2.0, 0.0],
                  [np.nan, 1.0, 2.0, 0.0],
                  [1000.0, -1000.0, 999.0, 0.0]]).T[None]   # (1, n=4, Q=5)
    with np.errstate(invalid="ignore"):
        expected = scipy.special.softmax(x, axis=1)
    p = bk.softmax(x)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(expected))
    np.testing.assert_allclose(p, expected, rtol=1e-14)


def test_fastest_base_follows_numpy_dispatch():
    """exp2 (base 2) only where NumPy vectorises its float32 loop, else exp (base e)."""
    def targets(current):
        return {"exp2": {"ff": {"current": current, "available": "X86_V4 baseline(X86_V2)"}}}
    assert fastest_base(targets("X86_V4"), {}) is BASE_2
    assert fastest_base(targets("AVX512_SKX"), {}) is BASE_2
    assert fastest_base(targets("baseline(X86_V2)"), {"AVX512F": True}) is BASE_E
    assert fastest_base({}, {}) is BASE_E                # no exp2 entry: not vectorised
    assert fastest_base(None, {"AVX512F": True}) is BASE_2   # older NumPy: CPU flags
    assert fastest_base(None, {"AVX512F": False, "AVX2": True}) is BASE_E
    assert DEFAULT_CONFIG.base in (BASE_2, BASE_E)
    for base in (BASE_2, BASE_E):  # b^(x·log_b e) = e^x and log_b(e)·ln(b) = 1
        x = np.linspace(-30, 30, 61)
        np.testing.assert_allclose(base.exp(x * base.log_e), np.exp(x), rtol=1e-13)
        assert base.log_e * base.ln == pytest.approx(1.0, rel=1e-15)


# ---------------------------------------------------------------- configuration
def test_default_config_is_this_machines():
    """Built once: workers from the usable cores, the base from NumPy's dispatch table."""
    from cuflash.backends.numpy_backend.expbase import numpy_dispatch
    from cuflash.backends.numpy_backend.pool import usable_cores
    assert BK.config is DEFAULT_CONFIG
    assert DEFAULT_CONFIG.workers == usable_cores()
    assert DEFAULT_CONFIG.base is fastest_base(*numpy_dispatch())
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_CONFIG.rows = 8


@pytest.mark.parametrize("setting, value, error", [
    ("rows", 0, ValueError), ("workers", -1, ValueError), ("block_n", 2.5, TypeError),
    ("max_sample", True, TypeError), ("frozen_max", 1, TypeError), ("native", True, TypeError),
    ("native", "avx1024", ValueError), ("base", np.exp, TypeError),
])
def test_config_rejects_bad_settings(setting, value, error):
    with pytest.raises(error, match=rf"CpuConfig\.{setting} .*got {value!r}"):
        dataclasses.replace(DEFAULT_CONFIG, **{setting: value})


def test_backend_needs_a_config():
    with pytest.raises(TypeError, match="config must be a CpuConfig; got dict"):
        nb.NumpyBackend({"rows": 16})
    assert isinstance(nb.NumpyBackend().config, CpuConfig)


def test_settings_reach_the_loops(monkeypatch):
    """Tile sizes and workers come from the backend's config: the tasks handed to the
    pool have the config's rows and keys."""
    from cuflash.backends.numpy_backend import backward as bwd
    handed = []
    for module in (fwd, bwd):
        real = module.run_tasks
        monkeypatch.setattr(module, "run_tasks", lambda fn, tasks, workers, real=real:
                            handed.append((tasks, workers)) or real(fn, tasks, workers))
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, 1, 1, 1, 64, 96, 8, np.float32)
    bk = _backend(workers=3)
    o, lse = bk.forward(q, k, v, causal=False, scale=0.5)
    bk.backward(np.ones_like(q), q, k, v, o, lse, causal=False, scale=0.5)
    assert [workers for _, workers in handed] == [3] * 3   # tiles; prepare and tiles
    fwd_tiles = handed[0][0]
    bwd_tiles = [t for lane in handed[2][0] for t in lane]   # one ordered task list per worker
    # forward: 16-row Q tiles, each in 24-key steps; backward: 24-key tiles, 16-row steps
    assert [(r1 - r0, [c1 - c0 for _, _, c0, c1, _ in kv])
            for _, _, r0, r1, kv in fwd_tiles] == [(16, [24] * 4)] * 4
    assert [(c1 - c0, [r1 - r0 for r0, r1, *_ in qt])
            for _, _, c0, c1, qt in bwd_tiles] == [(24, [16] * 4)] * 4
    handed.clear()
    _backend(DEFAULT_CONFIG, workers=1, native="off").forward(q, k, v, causal=False, scale=0.5)
    (_, _, r0, r1, kv), = handed[0][0]                      # one tile: all rows, all keys
    assert (r1 - r0, [c1 - c0 for _, _, c0, c1, _ in kv]) == (64, [96])
