"""The public API, one test body per behaviour, run on every backend.

Everything is compared with the float64 reference (`cuflash.reference`), which is
itself checked against scipy.special.softmax in test_reference.py.
"""
import math

import numpy as np
import pytest
import scipy.special

import cuflash
from cuflash import _dtypes, reference
from conftest import (DTYPES, HAS_GPU, assert_close_to_reference, plain_attention,
                      plain_backward, round_to, to_backend, to_host)


def rand(rng, shape, dtype, low=-1.0, high=1.0):
    return rng.uniform(low, high, shape).astype(dtype)


# (q shape, k shape, causal): batch axes, GQA/MQA, Nq != Nk both ways, odd sizes.
FORWARD_CASES = [
    ((1, 1, 1), (1, 1, 1), False),
    ((17, 32), (17, 32), True),
    ((2, 113, 59), (2, 203, 59), False),
    ((2, 113, 40), (2, 203, 40), True),
    ((1, 4, 203, 64), (1, 2, 113, 64), True),        # GQA, Nq > Nk: fully masked rows
    ((2, 3, 17, 96), (2, 1, 113, 96), False),        # MQA
    ((2, 1, 2, 33, 128), (2, 1, 1, 47, 128), True),  # two batch axes
    ((1, 1, 64, 256), (1, 1, 64, 256), False),
]


def case_id(case):
    qs, ks, causal = case
    return f"q{'x'.join(map(str, qs))}-k{'x'.join(map(str, ks))}{'-causal' if causal else ''}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
def test_forward_matches_reference(backend, dtype, case):
    q_shape, k_shape, causal = case
    rng = np.random.default_rng(0)
    q, k, v = (rand(rng, s, dtype) for s in (q_shape, k_shape, k_shape))
    scale = 1 / math.sqrt(q_shape[-1])

    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=causal,
                                     return_lse=True, backend=backend)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, return_lse=True)

    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == _dtypes.lse_dtype(dtype)
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype)
    assert_close_to_reference(o, ref_o, plain, dtype)
    # lse is accumulated in float32 (float64) for every dtype: the full-precision bound.
    assert_close_to_reference(lse, ref_lse, None, _dtypes.lse_dtype(dtype), what="lse")


@pytest.mark.parametrize("causal", [False, True])
def test_fa1_equals_fa2(backend, causal):
    rng = np.random.default_rng(1)
    q = rand(rng, (2, 4, 113, 40), np.float32)
    k, v = rand(rng, (2, 2, 203, 40), np.float32), rand(rng, (2, 2, 203, 40), np.float32)
    args = to_backend(backend, q, k, v)
    o1, lse1 = cuflash.flash_attention(*args, causal=causal, algorithm="fa1",
                                       return_lse=True, backend=backend)
    o2, lse2 = cuflash.flash_attention(*args, causal=causal, algorithm="fa2",
                                       return_lse=True, backend=backend)
    np.testing.assert_allclose(to_host(o1), to_host(o2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_host(lse1), to_host(lse2), rtol=1e-5, atol=1e-6)


def test_scale_argument(backend):
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, (3, 17, 8), np.float64) for _ in range(3))
    o = cuflash.flash_attention(*to_backend(backend, q, k, v), scale=0.37, backend=backend)
    np.testing.assert_allclose(to_host(o), reference.naive_attention(q, k, v, scale=0.37),
                               rtol=1e-10, atol=1e-12)


def test_strided_inputs(backend):
    """(B, N, H, d) layouts, as transformer code holds them, are viewed, not copied."""
    rng = np.random.default_rng(3)
    q = rand(rng, (2, 113, 4, 32), np.float32).swapaxes(1, 2)
    kv = rand(rng, (2, 97, 2, 2, 32), np.float32)
    k, v = kv[:, :, 0].swapaxes(1, 2), kv[:, :, 1].swapaxes(1, 2)
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    o = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True, backend=backend)
    ref = reference.naive_attention(q, k, v, causal=True)
    np.testing.assert_allclose(to_host(o), ref, rtol=1e-5, atol=2e-5)


def test_fully_masked_rows_give_zero_and_no_nan(backend):
    """Causal with Nq > Nk: the first Nq - Nk query rows see no key."""
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (2, 40, 16), np.float32), rand(rng, (2, 25, 16), np.float32), \
        rand(rng, (2, 25, 16), np.float32)
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True,
                                     return_lse=True, backend=backend)
    o, lse = to_host(o), to_host(lse)
    assert np.all(o[:, :15] == 0) and np.all(lse[:, :15] == -np.inf)
    assert np.all(np.isfinite(o[:, 15:])) and np.all(np.isfinite(lse[:, 15:]))
    do = rand(rng, q.shape, np.float32)
    grads = cuflash.flash_attention_backward(
        *to_backend(backend, do, q, k, v), *to_backend(backend, o, lse), causal=True,
        backend=backend)
    for g in map(to_host, grads):
        assert np.all(np.isfinite(g))
    assert np.all(to_host(grads[0])[:, :15] == 0)


def test_nan_and_inf_scores(backend):
    """NaN stays in its row; -inf scores are masked keys; +inf is as in scipy."""
    rng = np.random.default_rng(5)
    q = rng.uniform(0.1, 1.0, (3, 33, 16)).astype(np.float32)
    k, v = rand(rng, (3, 47, 16), np.float32), rand(rng, (3, 47, 16), np.float32)
    q[0, 5] = np.nan            # one NaN query row in head 0
    k[1, 9] = -np.inf           # key 9 of head 1 scores -inf for every (positive) query
    k[2, 3] = np.inf            # key 3 of head 2 scores +inf: scipy gives NaN rows
    o = to_host(cuflash.flash_attention(*to_backend(backend, q, k, v), backend=backend))
    with np.errstate(invalid="ignore"):
        ref = reference.naive_attention(q, k, v)
    assert np.all(np.isnan(o[0, 5])) and np.all(np.isfinite(np.delete(o[0], 5, axis=0)))
    keep = np.arange(47) != 9
    np.testing.assert_allclose(o[1], reference.naive_attention(q[1], k[1, keep], v[1, keep]),
                               rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isnan(o[2]), np.isnan(ref[2]))


def test_backward_nan_stays_in_its_row(backend):
    """A NaN query row: dq is NaN in that row only, dv in the rows of the keys it sees
    only (keys hidden by the causal mask and other heads keep their gradients). dk turns
    NaN in every key of the head: dK = dSᵀ Q multiplies the row's masked zeros by its NaN
    query (0·NaN = NaN), as a plain matmul would."""
    rng = np.random.default_rng(8)
    q, k, v, do = (rand(rng, (2, 30, 16), np.float32) for _ in range(4))
    i = 9
    q[0, i, 3] = np.nan
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True,
                                     return_lse=True, backend=backend)
    dq, dk, dv = map(to_host, cuflash.flash_attention_backward(
        *to_backend(backend, do, q, k, v), o, lse, causal=True, backend=backend))
    assert np.isnan(dq[0, i]).all() and np.isnan(dv[0, :i + 1]).all()
    # The rest is what it would be with a finite row there.
    clean = q.copy()
    clean[0, i] = 0
    ref_o, ref_lse = reference.naive_attention(clean, k, v, causal=True, return_lse=True)
    ref = reference.attention_backward(do, clean, k, v, ref_o, ref_lse, causal=True)
    other_rows, hidden_keys = np.arange(30) != i, np.arange(30) > i
    np.testing.assert_allclose(dq[0, other_rows], ref[0][0, other_rows], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dv[0, hidden_keys], ref[2][0, hidden_keys], rtol=1e-4, atol=1e-5)
    for got, want in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)


# (q shape, k shape, bias shape): no query, no key, batch 0, heads 0, both 0, GQA without
# queries. The bias broadcasts over an axis of length 0 in some cases, so its dbias is not
# empty: it must come back as zeros of the bias's own shape.
EMPTY_CASES = [
    ((0, 16), (5, 16), (1, 5)), ((5, 16), (0, 16), (5, 1)),
    ((0, 2, 7, 8), (0, 2, 9, 8), (7, 9)), ((2, 0, 7, 8), (2, 0, 9, 8), (1, 1, 7, 9)),
    ((0, 8), (0, 8), (1, 1)), ((3, 0, 8), (1, 6, 8), (3, 1, 6)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", EMPTY_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}")
def test_empty_inputs(backend, shapes, dtype):
    """Every output of an empty problem, as docs/api.md defines it: o and lse in their
    shapes and dtypes, o = 0 and lse = −inf for rows without keys; dq, dk, dv, dbias in
    the shapes and dtypes of q, k, v, bias, all exactly 0 (no (query, key) pair
    contributes to any gradient)."""
    q_shape, k_shape, bias_shape = shapes
    q, k = np.ones(q_shape, dtype), np.full(k_shape, 2.0, dtype)
    bias = np.ones(bias_shape, dtype)
    for opts in ({}, {"bias": bias}):
        o, lse = cuflash.flash_attention(*to_backend(backend, q, k, k), return_lse=True,
                                         backend=backend, **_on(backend, opts))
        assert o.shape == q_shape and o.dtype == dtype
        assert lse.shape == q_shape[:-1] and lse.dtype == _dtypes.lse_dtype(dtype)
        o, lse = to_host(o), to_host(lse)
        assert np.all(o == 0) and np.all(lse == -np.inf)  # no key: rows are fully masked
        grads = cuflash.flash_attention_backward(
            *to_backend(backend, q, q, k, k, o, lse), backend=backend,
            return_dbias=bool(opts), **_on(backend, opts))
        wanted = (q, k, k, bias) if opts else (q, k, k)
        assert len(grads) == len(wanted)
        for name, g, x in zip(("dq", "dk", "dv", "dbias"), grads, wanted):
            assert g.shape == x.shape and g.dtype == x.dtype, name
            np.testing.assert_array_equal(to_host(g).astype(np.float64), 0.0, err_msg=name)


def _on(backend, opts):
    return {n: to_backend(backend, x) for n, x in opts.items()}


# -- backward ---------------------------------------------------------------------------

BACKWARD_CASES = [
    ((17, 32), (17, 32), False),
    ((2, 113, 59), (2, 203, 59), True),
    ((1, 4, 113, 64), (1, 2, 47, 64), True),   # GQA, Nq > Nk
    ((2, 3, 33, 16), (2, 1, 33, 16), False),   # MQA
    ((1, 1, 40, 128), (1, 1, 40, 128), True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=case_id)
def test_backward_matches_reference(backend, dtype, case):
    q_shape, k_shape, causal = case
    rng = np.random.default_rng(6)
    q, k, v = (rand(rng, s, dtype) for s in (q_shape, k_shape, k_shape))
    do = rand(rng, q_shape, dtype)
    scale = 1 / math.sqrt(q_shape[-1])
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=causal,
                                     return_lse=True, backend=backend)
    grads = cuflash.flash_attention_backward(*to_backend(backend, do, q, k, v), o, lse,
                                             causal=causal, backend=backend)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, return_lse=True)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, causal=causal)
    plains = plain_backward(do, q, k, v, ref_o, ref_lse, causal=causal, scale=scale,
                            dtype=dtype)
    for name, g, x, ref, plain in zip("qkv", grads, (q, k, v), refs, plains):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_close_to_reference(g, ref, plain, dtype, factor=3.0, what=f"d{name}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_backward_not_deterministic_matches_reference(backend, dtype):
    """deterministic=False (atomic dQ in the GPU kernels' five-GEMM backward, no effect
    elsewhere): the gradients within the rule, dk and dv the deterministic call's bits."""
    rng = np.random.default_rng(8)
    q, k, v, do = (rand(rng, (2, 4, 150, 64), dtype) for _ in range(4))
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True,
                                     return_lse=True, backend=backend)
    args = (*to_backend(backend, do, q, k, v), o, lse)
    grads = cuflash.flash_attention_backward(*args, causal=True, backend=backend,
                                             deterministic=False)
    same = cuflash.flash_attention_backward(*args, causal=True, backend=backend)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=True, return_lse=True)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, causal=True)
    plains = plain_backward(do, q, k, v, ref_o, ref_lse, causal=True, scale=0.125, dtype=dtype)
    for name, g, ref, plain in zip("qkv", grads, refs, plains):
        assert_close_to_reference(g, ref, plain, dtype, factor=3.0, what=f"d{name}")
    for g, h in zip(grads[1:], same[1:]):
        np.testing.assert_array_equal(to_host(g), to_host(h))


def test_backward_matches_finite_differences(backend):
    """dL/dx for L = sum(O * W), by central differences in float64."""
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (2, 6, 5), np.float64), rand(rng, (1, 9, 5), np.float64), \
        rand(rng, (1, 9, 5), np.float64)
    w = rand(rng, q.shape, np.float64)

    def loss(q, k, v):
        o = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True,
                                    backend=backend)
        return float(np.sum(to_host(o) * w))

    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), causal=True,
                                     return_lse=True, backend=backend)
    grads = cuflash.flash_attention_backward(*to_backend(backend, w, q, k, v), o, lse,
                                             causal=True, backend=backend)
    eps = 1e-6
    for i, (x, g) in enumerate(zip((q, k, v), grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[i][idx] += eps
            up = loss(*args)
            args[i][idx] -= 2 * eps
            numeric[idx] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(to_host(g), numeric, rtol=1e-6, atol=1e-8)


# -- online softmax ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_online_softmax_every_axis(backend, dtype):
    rng = np.random.default_rng(8)
    x = rand(rng, (3, 17, 5, 40), dtype, -8, 8)
    for axis in (None, 0, 1, 2, 3, -1, -3):
        p = cuflash.online_softmax(to_backend(backend, x), axis=axis, backend=backend)
        ref = scipy.special.softmax(x.astype(np.float64), axis=axis)
        assert p.shape == x.shape and p.dtype == x.dtype
        plain = round_to(scipy.special.softmax(x.astype(np.float32), axis=axis), dtype)
        assert_close_to_reference(p, ref, plain, dtype, what=f"softmax axis={axis}")


def test_online_softmax_nan_inf(backend):
    x = np.array([[1.0, 2.0, 3.0, 0.5],
                  [np.nan, 1.0, 2.0, 3.0],
                  [-np.inf, 1.0, -np.inf, 2.0],
                  [np.inf, 1.0, 2.0, 3.0],
                  [-np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    p = to_host(cuflash.online_softmax(to_backend(backend, x), axis=1, backend=backend))
    with np.errstate(invalid="ignore"):
        ref = scipy.special.softmax(x.astype(np.float64), axis=1)
    np.testing.assert_allclose(p, ref, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_online_softmax_empty_and_scalar(backend):
    p = cuflash.online_softmax(to_backend(backend, np.zeros((0, 5), np.float32)),
                               backend=backend)
    assert p.shape == (0, 5)
    p = cuflash.online_softmax(to_backend(backend, np.float64(3.0) * np.ones(())),
                               axis=None, backend=backend)
    assert to_host(p) == 1.0


# -- errors ------------------------------------------------------------------------------

F32 = np.ones((2, 8, 16), np.float32)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: cuflash.flash_attention(F32, F32, F32[..., :8]), ValueError, "k and v"),
    (lambda: cuflash.flash_attention(F32[..., :8], F32, F32), ValueError, "head dim"),
    (lambda: cuflash.flash_attention(F32[0, 0], F32[0, 0], F32[0, 0]), ValueError,
     "at least 2"),
    (lambda: cuflash.flash_attention(F32, F32[None], F32[None]), ValueError,
     "number of dimensions"),
    (lambda: cuflash.flash_attention(np.ones((3, 8, 16), np.float32), F32, F32),
     ValueError, "multiple of"),
    (lambda: cuflash.flash_attention(np.ones((2, 2, 8, 16), np.float32),
                                     np.ones((3, 2, 8, 16), np.float32),
                                     np.ones((3, 2, 8, 16), np.float32)),
     ValueError, "batch axes"),
    (lambda: cuflash.flash_attention(F32, F32.astype(np.float16), F32), TypeError,
     "share one dtype"),
    (lambda: cuflash.flash_attention(F32.astype(int), F32.astype(int), F32.astype(int)),
     TypeError, "floating-point"),
    (lambda: cuflash.flash_attention(F32.astype(np.complex64), F32, F32), TypeError,
     "not supported"),
    (lambda: cuflash.flash_attention(np.ones((2, 0), np.float32), np.ones((2, 0), np.float32),
                                     np.ones((2, 0), np.float32)), ValueError, ">= 1"),
    (lambda: cuflash.flash_attention(F32, F32, F32, backend="tpu"), ValueError, "backend"),
    (lambda: cuflash.flash_attention(F32, F32, F32, algorithm="fa3"), ValueError,
     "algorithm"),
    (lambda: cuflash.flash_attention(F32, F32, F32, causal="yes"), TypeError, "causal"),
    (lambda: cuflash.flash_attention(F32, F32, F32, scale="big"), TypeError, "scale"),
    (lambda: cuflash.flash_attention(F32, F32, F32, scale=float("nan")), ValueError,
     "scale"),
    (lambda: cuflash.flash_attention_backward(F32, F32, F32, F32, F32, F32), ValueError,
     "lse"),
    (lambda: cuflash.flash_attention_backward(F32[:, :4], F32, F32, F32, F32, F32[..., 0]),
     ValueError, "do"),
    (lambda: cuflash.flash_attention_backward(F32, F32, F32, F32, F32.astype(np.float64),
                                              F32[..., 0]), TypeError, "o"),
    (lambda: cuflash.flash_attention_backward(F32, F32, F32, F32, F32, F32[..., 0],
                                              deterministic=None), TypeError,
     r"deterministic must be True or False; got None"),
    (lambda: cuflash.online_softmax(F32, axis=3), ValueError, "axis"),
    (lambda: cuflash.online_softmax(F32, axis=1.5), TypeError, "axis"),
    (lambda: cuflash.online_softmax(np.arange(4)), TypeError, "floating-point"),
])
def test_errors_name_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_gpu_arrays_need_the_cuda_backend():
    class FakeGpuArray:
        __cuda_array_interface__ = {"shape": (2, 2), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
        shape, dtype = (2, 2), np.dtype(np.float32)

    with pytest.raises(TypeError, match="backend='cuda'"):
        cuflash.flash_attention(FakeGpuArray(), F32[0], F32[0], backend="numpy")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_foreign_gpu_arrays_are_taken_zero_copy():
    """Arrays of other GPU libraries come in through __cuda_array_interface__ or DLPack."""
    import cupy
    from cuflash._dispatch import to_cupy

    class ViaInterface:
        def __init__(self, a):
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    class ViaDLPack:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    q = cupy.random.standard_normal((2, 64, 32), dtype=cupy.float32)
    for wrap in (ViaInterface, ViaDLPack):
        assert to_cupy("q", wrap(q)).data.ptr == q.data.ptr  # a view, not a copy
        o = cuflash.flash_attention(wrap(q), wrap(q), wrap(q), causal=True)
        assert isinstance(o, cupy.ndarray)
        h = q.get()
        np.testing.assert_allclose(o.get(), reference.naive_attention(h, h, h, causal=True),
                                   rtol=1e-5, atol=2e-5)


# -- GPU placement: the arrays' device, the current stream --------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_runs_on_the_current_stream():
    """Work goes to the current CuPy stream: on a non-blocking stream, synchronising that
    stream alone makes the results ready."""
    import cupy
    rng = np.random.default_rng(11)
    q, k, v = (rand(rng, (2, 4, 300, 64), np.float32) for _ in range(3))
    qd, kd, vd = to_backend("cuda", q, k, v)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        o, lse = cuflash.flash_attention(qd, kd, vd, causal=True, return_lse=True)
        grads = cuflash.flash_attention_backward(cupy.ones_like(o), qd, kd, vd, o, lse,
                                                 causal=True)
    stream.synchronize()
    ref = reference.naive_attention(q, k, v, causal=True)
    np.testing.assert_allclose(to_host(o), ref, atol=2e-5)
    assert all(np.isfinite(to_host(g)).all() for g in grads)


def _gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA devices")
def test_runs_on_the_device_of_its_arrays():
    import cupy
    rng = np.random.default_rng(12)
    q, k, v = (rand(rng, (1, 2, 100, 32), np.float32) for _ in range(3))
    with cupy.cuda.Device(1):
        q1, k1, v1 = to_backend("cuda", q, k, v)
    o = cuflash.flash_attention(q1, k1, v1)          # current device: 0
    assert o.device.id == 1
    np.testing.assert_allclose(to_host(o), reference.naive_attention(q, k, v), atol=2e-5)
    with pytest.raises(ValueError, match="one GPU"):
        cuflash.flash_attention(q1, cupy.asarray(k), v1)
