"""The float64 references agree with scipy, with each other and with finite differences."""
import itertools
import math

import numpy as np
import pytest
import scipy.special

from cuflash import reference as R
from cuflash.tiling import paper_block_sizes

SIZES = (1, 17, 113, 203)
HEAD_DIMS = (1, 32, 59, 64)


def _qkv(rng, Nq, Nk, d, hq=1, hkv=1, batch=()):
    q = rng.standard_normal(batch + (hq, Nq, d))
    k = rng.standard_normal(batch + (hkv, Nk, d))
    v = rng.standard_normal(batch + (hkv, Nk, d))
    return q, k, v


def _direct(q, k, v, causal, scale=None):
    """Attention written straight from the definition, one head at a time."""
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    lse = np.empty(q.shape[:-1])
    g = q.shape[-3] // k.shape[-3]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    Nq, Nk = q.shape[-2], k.shape[-2]
    for idx in np.ndindex(*q.shape[:-2]):
        kv_idx = idx[:-1] + (idx[-1] // g,)
        s = scale * q[idx] @ k[kv_idx].T
        for i in range(Nq):
            row = s[i].copy()
            if causal:
                row[np.arange(Nk) > i + Nk - Nq] = -np.inf
            if np.all(row == -np.inf):
                out[idx][i], lse[idx][i] = 0.0, -np.inf
                continue
            out[idx][i] = scipy.special.softmax(row) @ v[kv_idx]
            lse[idx][i] = scipy.special.logsumexp(row)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq,Nk,d", [(17, 17, 8), (5, 23, 3), (23, 5, 3), (1, 9, 4), (9, 1, 2)])
def test_naive_matches_direct_formula(Nq, Nk, d, causal):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, Nq, Nk, d, hq=4, hkv=2, batch=(2,))
    o, lse = R.naive_attention(q, k, v, causal=causal, return_lse=True)
    o_ref, lse_ref = _direct(q, k, v, causal)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-12, atol=1e-12)
    assert not np.isnan(o).any()


def test_naive_causal_mask_is_bottom_right():
    assert R.causal_mask(2, 4).tolist() == [[False, False, False, True],
                                            [False, False, False, False]]
    assert R.causal_mask(4, 2).tolist() == [[True, True], [True, True],
                                            [False, True], [False, False]]


def test_naive_batch_broadcast_and_mqa():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4, 7, 5))
    k = rng.standard_normal((1, 1, 9, 5))
    v = rng.standard_normal((1, 1, 9, 5))
    o = R.naive_attention(q, k, v)
    o_ref, _ = _direct(q, np.broadcast_to(k, (3, 1, 9, 5)), np.broadcast_to(v, (3, 1, 9, 5)), False)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)


def test_naive_scale_and_dtype():
    rng = np.random.default_rng(2)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, 6, 7, 3))
    o = R.naive_attention(q, k, v, scale=0.3)
    assert o.dtype == np.float64
    np.testing.assert_allclose(o, _direct(q.astype(float), k.astype(float), v.astype(float),
                                          False, 0.3)[0], rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fa1_fa2_match_naive(d, causal):
    rng = np.random.default_rng(d)
    for Nq, Nk in itertools.product(SIZES, SIZES):
        q, k, v = _qkv(rng, Nq, Nk, d)
        o, lse = R.naive_attention(q, k, v, causal=causal, return_lse=True)
        for fn in (R.fa1_attention, R.fa2_attention):
            o2, lse2 = fn(q, k, v, causal=causal, return_lse=True)
            np.testing.assert_allclose(o2, o, rtol=1e-10, atol=1e-12,
                                       err_msg=f"{fn.__name__} Nq={Nq} Nk={Nk}")
            np.testing.assert_array_equal(np.isneginf(lse2), np.isneginf(lse))
            fin = np.isfinite(lse)
            np.testing.assert_allclose(lse2[fin], lse[fin], rtol=1e-12, atol=1e-12)
            assert not np.isnan(o2).any()


@pytest.mark.parametrize("M", [16, 100, 4096, 1 << 20])
def test_fa_block_rule_any_memory(M):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 37, 29, 5, hq=4, hkv=2, batch=(2,))
    o = R.naive_attention(q, k, v, causal=True)
    np.testing.assert_allclose(R.fa1_attention(q, k, v, causal=True, M=M), o, atol=1e-12)
    np.testing.assert_allclose(R.fa2_attention(q, k, v, causal=True, M=M), o, atol=1e-12)


def test_block_sizes_rule():
    """The papers' rule (tiling.paper_block_sizes), worked by hand: (Br, Bc)."""
    assert paper_block_sizes(4096, 64) == (16, 16)
    assert paper_block_sizes(4096, 1) == (1, 1024)
    assert paper_block_sizes(100, 8) == (4, 4)
    assert paper_block_sizes(2, 1) == (1, 1)  # the seed notebook's N=2, d=1, M=2
    assert paper_block_sizes(100 * 1024 // 4, 64) == (64, 100)


def test_fully_masked_rows():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 9, 4, 3)
    for fn in (R.naive_attention, R.fa1_attention, R.fa2_attention):
        o, lse = fn(q, k, v, causal=True, return_lse=True)
        assert np.all(o[..., :5, :] == 0) and np.all(lse[..., :5] == -np.inf)
        assert np.isfinite(o).all() and np.isfinite(lse[..., 5:]).all()


def test_nan_and_inf_rows():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 6, 8, 3)
    q[..., 1, 0] = np.nan           # NaN scores in row 1 only
    k[..., 2, :] = 0.0
    q[..., 3, :] = [np.inf, 0, 0]   # row 3: scores ±inf / NaN
    with np.errstate(invalid="ignore"):
        o, lse = R.naive_attention(q, k, v, return_lse=True)
        for fn in (R.fa1_attention, R.fa2_attention):
            o2 = fn(q, k, v)
            np.testing.assert_array_equal(np.isnan(o2), np.isnan(o))
            ok = ~np.isnan(o)
            np.testing.assert_allclose(o2[ok], o[ok], atol=1e-12)
    assert np.isnan(o[..., 1, :]).all() and np.isnan(o[..., 3, :]).all()
    assert np.isfinite(np.delete(o, [1, 3], axis=-2)).all()


# ---------------------------------------------------------------- backward
def _numerical_grads(q, k, v, W, causal, eps=1e-6):
    """Central differences of loss = sum(O ∘ W) over every input element."""
    grads = []
    for x in (q, k, v):
        g = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            old = x[idx]
            x[idx] = old + eps
            lp = np.sum(R.naive_attention(q, k, v, causal=causal) * W)
            x[idx] = old - eps
            lm = np.sum(R.naive_attention(q, k, v, causal=causal) * W)
            x[idx] = old
            g[idx] = (lp - lm) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq,Nk,hq,hkv", [(4, 4, 1, 1), (3, 5, 2, 1), (5, 3, 2, 2), (4, 6, 4, 2)])
def test_backward_vs_finite_differences(Nq, Nk, hq, hkv, causal):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, Nq, Nk, 3, hq=hq, hkv=hkv)
    W = rng.standard_normal((hq, Nq, 3))
    o, lse = R.naive_attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = R.attention_backward(W, q, k, v, o, lse, causal=causal)
    nq, nk, nv = _numerical_grads(q, k, v, W, causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for a, n in ((dq, nq), (dk, nk), (dv, nv)):
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-8)
        assert np.isfinite(a).all()


def test_backward_scale_and_masked_rows_are_zero():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 6, 3, 2)
    W = rng.standard_normal(q.shape)
    o, lse = R.naive_attention(q, k, v, causal=True, scale=0.7, return_lse=True)
    dq, dk, dv = R.attention_backward(W, q, k, v, o, lse, causal=True, scale=0.7)
    assert np.all(dq[..., :3, :] == 0) and np.isfinite(dk).all() and np.isfinite(dv).all()
    # Scale: compare with finite differences through a scaled naive attention.
    eps, i = 1e-6, (0, 4, 1)
    qp, qm = q.copy(), q.copy()
    qp[i] += eps
    qm[i] -= eps
    num = (np.sum(R.naive_attention(qp, k, v, causal=True, scale=0.7) * W)
           - np.sum(R.naive_attention(qm, k, v, causal=True, scale=0.7) * W)) / (2 * eps)
    assert abs(dq[i] - num) < 1e-7


# ---------------------------------------------------------------- softmax
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_online_softmax_every_axis(axis):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 7, 3)) * 20
    np.testing.assert_allclose(R.online_softmax(x, axis), scipy.special.softmax(x, axis=axis),
                               rtol=1e-13, atol=1e-300)


def test_online_softmax_nan_inf_like_scipy():
    x = np.array([[-np.inf, -np.inf, -np.inf],
                  [-np.inf, 1.0, 2.0],
                  [np.inf, 1.0, 2.0],
                  [np.nan, 1.0, 2.0],
                  [1000.0, -1000.0, 999.0]])
    with np.errstate(invalid="ignore"):
        expected = scipy.special.softmax(x, axis=1)
    np.testing.assert_allclose(R.online_softmax(x, axis=1), expected, rtol=1e-14)
    assert np.isnan(R.online_softmax(x, 1)[0]).all()


# ---------------------------------------------------------------- variants, worked by hand
# Query i sees key j through i' = i + Nk − Nq (bottom-right alignment); window (left, right)
# keeps i' − left ≤ j ≤ i' + right, causal keeps j ≤ i'. Every row below is written out.
T, F = True, False


@pytest.mark.parametrize("Nq, Nk, causal, window, expected", [
    # Nq = 3, Nk = 4, window (1, 0): i' = 1, 2, 3 sees keys {0, 1}, {1, 2}, {2, 3}
    (3, 4, False, (1, 0), [[T, T, F, F], [F, T, T, F], [F, F, T, T]]),
    # causal, Nq < Nk: j ≤ i + 1
    (3, 4, True, None, [[T, T, F, F], [T, T, T, F], [T, T, T, T]]),
    # causal, Nq > Nk: j ≤ i − 2, so rows 0 and 1 see no key
    (4, 2, True, None, [[F, F], [F, F], [T, F], [T, T]]),
    # window (2, 1), Nq = Nk: i − 2 ≤ j ≤ i + 1
    (4, 4, False, (2, 1), [[T, T, F, F], [T, T, T, F], [T, T, T, T], [F, T, T, T]]),
    # the same window with causal: the right edge becomes j ≤ i
    (4, 4, True, (2, 1), [[T, F, F, F], [T, T, F, F], [T, T, T, F], [F, T, T, T]]),
    # causal with a left window, Nq = 2, Nk = 5: i' = 3, 4 sees {2, 3}, {3, 4}
    (2, 5, True, (1, -1), [[F, F, T, T, F], [F, F, F, T, T]]),
    # left unbounded, right 0, Nq > Nk: i' = i − 1
    (3, 2, False, (-1, 0), [[F, F], [T, F], [T, T]]),
])
def test_visible_keys_worked_examples(Nq, Nk, causal, window, expected):
    assert R.visible_keys(Nq, Nk, causal=causal, window=window).tolist() == expected


# q = [1, 2], k = [1, 0, −1] (d = 1, scale 1): S = [[1, 0, −1], [2, 0, −2]];
# |i + Nk − Nq − j| = [[1, 0, 1], [2, 1, 0]].
_Q, _K = np.array([[1.0], [2.0]]), np.array([[1.0], [0.0], [-1.0]])
_TANH_HALF, _TANH_ONE = 0.46211715726000974, 0.7615941559557649   # tanh(0.5), tanh(1)


def test_attention_scores_chain_worked_example():
    """softcap 2, ALiBi slope 0.5, bias, then the mask, in that order:
    2·tanh(S/2) = [[0.9242343145200195, 0, −0.9242343145200195],
                   [1.5231883119115297, 0, −1.5231883119115297]]
    − 0.5·|i + 1 − j| + bias [[0.25, 0, 0], [0, 0, 1]], then keys (0, 2) and (1, 0) hidden."""
    bias = np.array([[0.25, 0.0, 0.0], [0.0, 0.0, 1.0]])
    mask = np.array([[T, T, F], [F, T, T]])
    Z, Tz = R.attention_scores(_Q, _K, scale=1.0, softcap=2.0, alibi_slopes=np.array(0.5),
                               bias=bias, mask=mask)
    expected = [[0.9242343145200195 - 0.5 + 0.25, 0.0, -np.inf],
                [-np.inf, -0.5, -1.5231883119115297 + 1.0]]
    np.testing.assert_allclose(Z, expected, rtol=1e-15, atol=0)
    np.testing.assert_allclose(Tz, [[_TANH_HALF, 0, -_TANH_HALF], [_TANH_ONE, 0, -_TANH_ONE]],
                               rtol=1e-15)
    # Without the mask the hidden entries are the chain's values: 1.5231883119115297 − 1 + 0
    # at (1, 0), −0.9242343145200195 − 0.5 at (0, 2).
    Z, _ = R.attention_scores(_Q, _K, scale=1.0, softcap=2.0, alibi_slopes=np.array(0.5),
                              bias=bias)
    np.testing.assert_allclose(Z[1, 0], 0.5231883119115297, rtol=1e-15)
    np.testing.assert_allclose(Z[0, 2], -1.4242343145200195, rtol=1e-15)


def test_alibi_per_head_worked_example():
    """Two heads, slopes 0.5 and 0.25, no other variant: S − slope·|i + 1 − j|."""
    q, k = np.broadcast_to(_Q, (1, 2, 2, 1)), np.broadcast_to(_K, (1, 2, 3, 1))
    Z, Tz = R.attention_scores(q, k, scale=1.0, alibi_slopes=np.array([0.5, 0.25]))
    assert Tz is None
    np.testing.assert_array_equal(Z, [[[[0.5, 0.0, -1.5], [1.0, -0.5, -2.0]],
                                       [[0.75, 0.0, -1.25], [1.5, -0.25, -2.0]]]])


def test_naive_attention_with_variants_worked_example():
    """The chain above, then softmax over the visible keys and · v, v = [1, 2, 4]:
    row 0 sees keys 0 and 1 with scores z = 0.6742343145200195 and 0: σ = 1/(1 + e^−z),
    o = σ·1 + (1 − σ)·2 = 1.337549356295595, lse = log(e^z + 1) = 1.08604353848587;
    row 1 sees keys 1 and 2 with −0.5 and −0.5231883119115297: o = 2.988406363528991,
    lse = 0.18162023532457003."""
    v = np.array([[1.0], [2.0], [4.0]])
    bias = np.array([[0.25, 0.0, 0.0], [0.0, 0.0, 1.0]])
    mask = np.array([[T, T, F], [F, T, T]])
    o, lse = R.naive_attention(_Q, _K, v, scale=1.0, softcap=2.0, alibi_slopes=np.array(0.5),
                               bias=bias, mask=mask, return_lse=True)
    np.testing.assert_allclose(o, [[1.337549356295595], [2.988406363528991]], rtol=1e-14)
    np.testing.assert_allclose(lse, [1.08604353848587, 0.18162023532457003], rtol=1e-14)
