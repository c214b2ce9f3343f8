"""cuflash.dask: attention on dask arrays against the float64 reference
(`cuflash.reference`), within FlashAttention's rule (conftest.error_bound).

Threaded scheduler for the chunking grid; one small problem on a distributed
LocalCluster of two processes on loopback.
"""
import warnings

import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_reference

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
import cuflash.dask as cdask  # noqa: E402

# (q shape, k shape, q chunks, k chunks): batch, head (GQA), query and key chunking.
CASES = [
    ((2, 4, 37, 16), (2, 2, 53, 16), (1, 2, 10, 16), (1, 1, 11, 16)),
    ((2, 4, 60, 16), (2, 2, 30, 16), (2, 4, 7, 16), (2, 2, 8, 16)),     # Nq > Nk
    ((1, 2, 5, 8), (1, 2, 50, 8), (1, 1, 2, 8), (1, 1, 3, 8)),           # decode-like
    ((40, 16), (40, 16), (13, 16), (9, 16)),                             # one head
    ((2, 3, 24, 8), (2, 1, 24, 8), (1, 3, 24, 8), (1, 1, 24, 8)),        # no q/k split
]


def data(case, dtype=np.float32, seed=0):
    qs, ks, qc, kc = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.uniform(-1, 1, s).astype(dtype) for s in (qs, ks, ks))
    return (q, k, v), tuple(da.from_array(x, chunks=c) for x, c in ((q, qc), (k, kc), (v, kc)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q" + "x".join(map(str, c[2])))
def test_forward_matches_reference(case, causal):
    (q, k, v), (dq_, dk_, dv_) = data(case)
    o, lse = cdask.flash_attention(dq_, dk_, dv_, causal=causal, return_lse=True,
                                   split_every=3)
    assert isinstance(o, da.Array) and o.chunks == dq_.chunks
    assert lse.chunks == dq_.chunks[:-1]
    with dask.config.set(scheduler="threads"):
        o, lse = dask.compute(o, lse)
    ro, rl = reference.naive_attention(q, k, v, causal=causal, return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_close_to_reference(o, ro, None, np.float32)
    assert_close_to_reference(lse, rl, None, np.float32, what="lse")  # −inf rows exactly


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_reference(causal):
    case = CASES[1]
    (q, k, v), (dq_, dk_, dv_) = data(case)
    do = np.random.default_rng(3).uniform(-1, 1, q.shape).astype(np.float32)
    o, lse = cdask.flash_attention(dq_, dk_, dv_, causal=causal, return_lse=True)
    with pytest.warns(UserWarning, match="rechunked to one chunk"):
        grads = cdask.flash_attention_backward(da.from_array(do, chunks=case[2]), dq_, dk_,
                                               dv_, o, lse, causal=causal, split_every=2)
    assert grads[0].chunks == dq_.chunks and grads[1].chunks == dk_.chunks
    with dask.config.set(scheduler="threads"):
        grads = dask.compute(*grads)
    ro, rl = reference.naive_attention(q, k, v, causal=causal, return_lse=True)
    want = reference.attention_backward(do, q, k, v, ro, rl, causal=causal)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == np.float32
        assert_close_to_reference(got, w, None, np.float32, factor=3.0, what=name)


def test_softcap_and_single_chunk_position_options():
    case = ((2, 4, 24, 8), (2, 2, 31, 8), (1, 2, 24, 8), (1, 1, 31, 8))
    (q, k, v), arrs = data(case, np.float64)
    slopes = np.linspace(0.1, 0.8, 4)
    opts = dict(causal=True, softcap=2.0, window=(6, 0), alibi_slopes=slopes)
    got = cdask.flash_attention(*arrs, **opts).compute(scheduler="threads")
    assert_close_to_reference(got, reference.naive_attention(q, k, v, **opts), None,
                              np.float64)
    # softcap is position-free: key chunks merge exactly
    (q, k, v), arrs = data(CASES[0], np.float64)
    got = cdask.flash_attention(*arrs, causal=True, softcap=1.5).compute(scheduler="threads")
    assert_close_to_reference(got, reference.naive_attention(q, k, v, causal=True, softcap=1.5),
                              None, np.float64)


def test_emulator_chunks():
    pytest.importorskip("ml_dtypes")
    (q, k, v), arrs = data(CASES[2])
    got = cdask.flash_attention(*arrs, causal=True, backend="emulator")
    assert_close_to_reference(got.compute(scheduler="threads"),
                              reference.naive_attention(q, k, v, causal=True), None,
                              np.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_no_task_sees_more_than_one_chunk_pair(monkeypatch, causal):
    """Every call the graph makes to cuflash.flash_attention gets at most one query chunk
    and one key chunk (and one head chunk): no task holds a block of scores bigger than
    a chunk pair, let alone Nq × Nk."""
    (q, k, v), arrs = data(CASES[0])
    seen = []
    real = cdask._attention

    def recording(q, k, v, **kw):
        seen.append((q.shape[-3], q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(cdask, "_attention", recording)
    o = cdask.flash_attention(*arrs, causal=causal).compute(scheduler="sync")
    assert_close_to_reference(o, reference.naive_attention(q, k, v, causal=causal), None,
                              np.float32)
    qc, kc = arrs[0].chunks, arrs[1].chunks
    assert seen and len(seen) >= len(qc[-2]) * len(kc[-2]) // 2
    for heads, nq, nk in seen:
        assert heads <= max(qc[-3]) and nq <= max(qc[-2]) and nk <= max(kc[-2]), (nq, nk)


def test_errors():
    x = np.zeros((2, 4, 16, 8), np.float32)
    kv = np.zeros((2, 2, 16, 8), np.float32)
    q = da.from_array(x, chunks=(1, 2, 8, 8))
    k = da.from_array(kv, chunks=(1, 1, 8, 8))
    with pytest.raises(ValueError, match=r"chunked alike along the batch axes .* got q "
                                         r"\(\(1, 1\),\), k \(\(2,\),\)"):
        cdask.flash_attention(q, da.from_array(kv, chunks=(2, 1, 8, 8)),
                              da.from_array(kv, chunks=(2, 1, 8, 8)))
    with pytest.raises(ValueError, match=r"head chunks of q must be those of k times "
                                         r"Hq/Hkv = 2, .*; got q \(2, 2\), k \(2,\)"):
        cdask.flash_attention(q, da.from_array(kv, chunks=(1, 2, 8, 8)),
                              da.from_array(kv, chunks=(1, 2, 8, 8)))
    with pytest.raises(ValueError, match="k and v must have the same chunks"):
        cdask.flash_attention(q, k, da.from_array(kv, chunks=(1, 1, 4, 8)))
    with pytest.raises(ValueError, match="dropout_p, seed are not supported by cuflash.dask"):
        cdask.flash_attention(q, k, k, dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match="window needs q in one chunk along the queries"):
        cdask.flash_attention(q, k, k, window=(3, 0))
    with pytest.raises(TypeError, match="must be a dask.array.Array"):
        cdask.flash_attention(x, k, k)
    with pytest.warns(UserWarning, match="head dim is never split"):
        cdask.flash_attention(da.from_array(x, chunks=(1, 2, 8, 4)), k, k)


def test_options_the_chunks_cannot_take_are_refused():
    """Every option of cuflash.flash_attention(_backward) that cuflash.dask cannot honour is
    a ValueError naming it (never ignored), arrays included; an unknown keyword is
    Python's TypeError."""
    x = np.zeros((1, 2, 16, 8), np.float32)
    q, k, v = (da.from_array(x, chunks=(1, 2, 8, 8)) for _ in range(3))
    lse = da.from_array(np.zeros((1, 2, 16), np.float32), chunks=(1, 2, 8))

    refused = dict(bias=np.ones((16, 16), np.float32), mask=np.ones((16, 16), bool),
                   dropout_p=0.1, seed=3, block_mask=object())
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"^{name} is not supported by cuflash.dask"):
            cdask.flash_attention(q, k, v, **{name: value})
        with pytest.raises(ValueError, match=rf"^{name} is not supported by cuflash.dask"):
            cdask.flash_attention_backward(q, q, k, v, q, lse, **{name: value})
    for name in ("return_dbias", "return_mod_grads"):
        with pytest.raises(ValueError, match=rf"^{name} is not supported by cuflash.dask"):
            cdask.flash_attention_backward(q, q, k, v, q, lse, **{name: True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        cdask.flash_attention(q, k, v, casual=True)


# mods that read every argument: a table over q_idx − kv_idx scaled per head and batch
# row, a document mask over the absolute positions (a document boundary inside chunks)
TABLE = np.linspace(-1.0, 1.0, 160)
DOCS = np.repeat(np.arange(6), 11)[:60]


def table_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[q_idx - kv_idx + 80] * (h + 1) - 0.25 * b


def same_doc(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) | (kv_idx < 2 + h)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=lambda c: "q" + "x".join(map(str, c[2])))
def test_mods_see_the_whole_problem(case, causal):
    """score_mod and mask_mod in chunks read the whole problem's b, h, q_idx and kv_idx
    (Mod.at): the float64 reference with the mods on the whole arrays, forward and
    backward, on the NumPy backend and for one case in the emulator's kernels."""
    from test_programmable import reference as mod_reference
    (q, k, v), arrs = data(case, np.float64, seed=4)
    do = np.random.default_rng(6).uniform(-1, 1, q.shape)
    mods = dict(score_mod=table_bias, mask_mod=same_doc)
    ro, rl, *rgrads = mod_reference(q, k, v, do, scale=q.shape[-1] ** -0.5, **mods)
    if causal:   # causal as a third mask, bottom-right aligned
        off = k.shape[-2] - q.shape[-2]

        def both(b, h, q_idx, kv_idx):
            return same_doc(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + off)
        ro, rl, *rgrads = mod_reference(q, k, v, do, scale=q.shape[-1] ** -0.5,
                                        score_mod=table_bias, mask_mod=both)
    backends = ["numpy"] + (["emulator"] if case is CASES[1] else [])
    for backend in backends:
        o, lse = cdask.flash_attention(*arrs, causal=causal, return_lse=True, backend=backend,
                                       **mods)
        o, lse = dask.compute(o, lse, scheduler="threads")
        assert_close_to_reference(o, ro, None, np.float64, what=f"o {backend}")
        np.testing.assert_allclose(lse, rl, rtol=1e-12, atol=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # keys rechunked to one chunk
            grads = cdask.flash_attention_backward(
                da.from_array(do, chunks=case[2]), *arrs, da.from_array(o, chunks=case[2]),
                da.from_array(lse, chunks=case[2][:-1]), causal=causal, backend=backend, **mods)
        for name, g, w in zip(("dq", "dk", "dv"), dask.compute(*grads, scheduler="threads"),
                              rgrads):
            assert_close_to_reference(g, w, None, np.float64, what=f"{name} {backend}")


def test_mods_need_one_batch_axis():
    x = da.zeros((2, 2, 2, 8, 4), chunks=(1, 2, 2, 8, 4))
    with pytest.raises(ValueError, match=r"score_mod and mask_mod need q with at most one "
                                         r"batch axis in cuflash.dask"):
        cdask.flash_attention(x, x, x, mask_mod=same_doc)


def test_allow_tf32_reaches_every_chunk():
    """allow_tf32=True runs one-pass tf32 in each task (float32 on the emulated sm_80): the
    same bits as the call on the whole problem, and not split tf32's."""
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, 2, 48, 32)).astype(np.float32) for _ in range(4))
    dq_, dk_, dv_, ddo = (da.from_array(x, chunks=(1, 1, 48, 32)) for x in (q, k, v, do))
    want = cuflash.flash_attention(q, k, v, allow_tf32=True, backend="emulator")
    got = cdask.flash_attention(dq_, dk_, dv_, allow_tf32=True, backend="emulator").compute()
    np.testing.assert_array_equal(got, want)
    split = cuflash.flash_attention(q, k, v, backend="emulator")
    assert not np.array_equal(got, split)
    o, lse = cuflash.flash_attention(q, k, v, allow_tf32=True, backend="emulator",
                                     return_lse=True)
    want = cuflash.flash_attention_backward(do, q, k, v, o, lse, allow_tf32=True,
                                            backend="emulator")
    got = cdask.flash_attention_backward(ddo, dq_, dk_, dv_, da.from_array(o, chunks=(1, 1, 48, 32)),
                                         da.from_array(lse, chunks=(1, 1, 48)), allow_tf32=True,
                                         backend="emulator")
    for g, w in zip(dask.compute(*got), want):
        np.testing.assert_array_equal(g, w)


def test_local_cluster_of_processes():
    distributed = pytest.importorskip("distributed")
    case = CASES[0]
    (q, k, v), arrs = data(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cluster's own start-up notices
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      host="127.0.0.1", dashboard_address=None,
                                      worker_dashboard_address=None) as cluster, \
                distributed.Client(cluster, timeout=60) as client:
            o = cdask.flash_attention(*arrs, causal=True)
            got = client.compute(o).result(timeout=120)
            workers = client.run(lambda: 1)
    assert len(workers) == 2
    assert_close_to_reference(got, reference.naive_attention(q, k, v, causal=True), None,
                              np.float32)
