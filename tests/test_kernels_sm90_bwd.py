"""The Hopper backward (kernels/flash_bwd_sm90.cu) in the emulator's sm_90a: the 5-GEMM pair
(the dK/dV pass adding dQ's parts into float32 partials, then their sum) and the dK/dV pass
with the dQ pass, TMA, mbarriers, a producer warpgroup, wgmma with P and dS from registers;
dQ, dK and dV against the float64 reference with FlashAttention's rule for gradients, in
checked mode (races, bounds, every asynchronous hazard) and bitwise equal under other block
schedules. And the same kernels on an H100 (`gpu`), for the day one is lent.
"""
import numpy as np
import pytest

from cuflash import _dtypes, reference, tiling
from cuflash.backends import kernel_backward, kernels
from cuflash.backends import kernel_backward_sm90 as sm90_bwd

from conftest import (DBIAS_LAYOUTS, HAS_GXX, assert_close_to_reference, attention_inputs,
                      backward_inputs, emulator_backend, hopper_gpu_backend, plain_backward,
                      to_host, variant_options, variants_of)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
F16, BF16 = np.dtype(np.float16), _dtypes.BFLOAT16


def _backend(checked=False, schedule="round-robin"):
    return kernels.emulator_backend(checked=checked, schedule=schedule, seed=3, arch="sm_90a")


FIVE_GEMMS = ["flash_bwd_dkdv_sm90", "flash_bwd_dq_sum_sm90"]
EVERY_KEY_BLOCK = 8   # dq_workers: the five GEMMs, a worker per key block (at most 8 here)
TWO_PASSES = ["flash_bwd_dkdv_sm90", "flash_bwd_dq_sm90"]


def _check(backend, B, Hq, Hkv, Nq, Nk, D, causal, dtype=F16, seed=0, opts=None,
           dq_workers=None):
    """dQ, dK, dV on `backend` within the rule (factor 3 over a plain dtype implementation);
    `opts` as flash_attention takes the variants (4-D bias and mask); `dq_workers` as
    backward_sm90 takes it (0: the dQ pass; a count: the five GEMMs, W at most the key
    blocks), and its launches are checked."""
    opts = opts or {}
    (do, q, k, v, o, lse), scale = backward_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, causal=causal,
                                                   seed=seed)
    if opts:   # o and lse of the forward with them
        o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                           **opts)
        o, lse = o.astype(dtype), lse.astype(np.float32)
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    xp = backend.xp
    grads = sm90_bwd.backward_sm90(backend, *map(xp.asarray, (do, q, k, v, lse, Dvec)),
                                   causal=causal, scale=scale, variants=variants_of(opts, xp),
                                   dq_workers=dq_workers)
    if hasattr(backend, "take_launches") and dq_workers is not None:
        assert [p.kernel for p in backend.take_launches()] == (
            TWO_PASSES if dq_workers == 0 else FIVE_GEMMS)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, **opts)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=dtype, **opts)
    for name, out, r, p, like in zip(("dq", "dk", "dv"), grads, ref, plain, (q, k, v)):
        assert out.shape == like.shape and out.dtype == like.dtype, name
        assert_close_to_reference(out, r, p, dtype, factor=3.0, what=f"{name} (D={D}, causal={causal})")
    return tuple(to_host(x) for x in grads)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,causal", [
    (1, 2, 1, 128, 256, False),    # whole tiles, MQA: the ring runs across the group's heads
    (2, 4, 2, 150, 200, True),     # GQA, partial query and key tiles, the diagonal inside
    (1, 2, 2, 200, 70, True),      # Nq > Nk: the first 130 rows see no key (dQ = 0)
])
def test_backward(dt, D, B, Hq, Hkv, Nq, Nk, causal):
    dq, _, _ = _check(_backend(), B, Hq, Hkv, Nq, Nk, D, causal, dtype=dt, seed=Nq + D,
                      dq_workers=EVERY_KEY_BLOCK)
    if causal and Nq > Nk:
        assert np.all(dq[..., :Nq - Nk, :].astype(np.float32) == 0)


@pytest.mark.parametrize("window,causal,Nq,Nk,workers", [
    ((40, 0), False, 200, 300, 8),       # left edge inside both passes' tiles, Nq < Nk
    ((100, 70), False, 300, 200, 0),     # both edges; rows that see no key (dQ = 0)
    ((130, -1), True, 256, 256, 8),      # causal with a left edge on a tile boundary + 2
    ((-1, 20), False, 150, 150, 0),      # the right edge alone
])
def test_window(window, causal, Nq, Nk, workers):
    """The sliding window: the query blocks (dK/dV) and key tiles (dQ) outside it are
    skipped, the steps its edges cross masked score by score; five GEMMs and two passes."""
    _check(_backend(), 1, 2, 1, Nq, Nk, 64, causal, seed=Nq + Nk, opts=dict(window=window),
           dq_workers=workers)


@pytest.mark.parametrize("names,causal,dt", [
    (["softcap"], False, F16), (["alibi"], True, BF16), (["bias"], False, F16),
    (["bias_f32"], True, F16), (["mask"], False, BF16), (["dropout"], True, F16),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, BF16),
], ids=lambda x: "+".join(x) if isinstance(x, list) else str(x))
def test_variants(names, causal, dt):
    """Every attention variant, alone and all at once, against the float64 reference
    (dropout's keep decisions are the forward's); GQA, partial tiles; all at once on both
    pairs."""
    B, Hq, Hkv, Nq, Nk = 2, 2, 1, 150, 200
    for workers in (EVERY_KEY_BLOCK, 0) if len(names) > 1 else (EVERY_KEY_BLOCK,):
        _check(_backend(), B, Hq, Hkv, Nq, Nk, 64, causal, dtype=dt, seed=7,
               opts=variant_options(names, dt, (B, Hq, Hkv, Nq, Nk, 64)), dq_workers=workers)


def _dbias_check(be, layout, B=2, Hq=4, Hkv=2, Nq=150, Nk=200, D=64):
    """kernel_backward.backward with a bias of `layout` and return_dbias on `be`: the
    Hopper kernels, dq, dk, dv within the rule, dbias (a float32 sum of float32 dS) within
    the float32 rule of the float64 reference."""
    (do, q, k, v, _, _), scale = backward_inputs(B, Hq, Hkv, Nq, Nk, D, F16, causal=True, seed=3)
    rng = np.random.default_rng(4)
    opts = dict(softcap=3.0,
                bias=rng.uniform(-1, 1, DBIAS_LAYOUTS[layout](B, Hq, Nq, Nk)).astype(np.float32))
    o, lse = reference.naive_attention(q, k, v, causal=True, scale=scale, return_lse=True, **opts)
    o, lse = o.astype(F16), lse.astype(np.float32)
    xp = be.xp
    grads = kernel_backward.backward(be, *map(xp.asarray, (do, q, k, v, o, lse)), causal=True,
                                     scale=scale, variants=variants_of(opts, xp),
                                     return_dbias=True)
    grads = [to_host(g) for g in grads]
    if hasattr(be, "take_launches"):   # dbias with a query axis: the dQ pass writes it;
        # else the five GEMMs where the worker model takes them (here: 2 workers of 1 key block)
        five = opts["bias"].shape[-2] == 1 and sm90_bwd.five_gemm_pair(
            be, tiling.sm90_bwd_plans("float16", D), units=B * Hkv, Nk=Nk)[1]
        assert list(dict.fromkeys(p.kernel for p in be.take_launches()))[-2:] == (
            FIVE_GEMMS if five else TWO_PASSES)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale,
                                       return_dbias=True, **opts)
    plain = plain_backward(do, q, k, v, o, lse, causal=True, scale=scale, dtype=F16, **opts)
    for name, out, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert_close_to_reference(out, r, p, F16, factor=3.0, what=f"{name} ({layout})")
    assert grads[3].shape == ref[3].shape and grads[3].dtype == np.float32
    assert_close_to_reference(grads[3], ref[3], None, np.dtype(np.float32),
                              what=f"dbias ({layout})")


@pytest.mark.parametrize("layout", list(DBIAS_LAYOUTS))
def test_dbias(layout):
    """dbias for every bias layout (dS before softcap's factor): a bias with its query axis
    by the dQ pass (one launch per head or batch row sharing a dbias row), one broadcast over
    query rows by the (5-GEMM) dK/dV pass's column sums; causal, softcap, GQA, ragged
    tiles."""
    _dbias_check(emulator_backend("sm_90a"), layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["full", "head+batch-broadcast", "query-broadcast"])
def test_dbias_on_the_gpu(layout):
    """The same on an H100."""
    be = hopper_gpu_backend()
    _dbias_check(be, layout, Nq=700, Nk=900, D=128)


def test_checked_mode():
    """Blocks whose query or key range the window cuts short, packed sequences, and every
    variant at ragged sizes: no hazard in checked mode, no bias or mask read outside
    [0, Nq) x [0, Nk)."""
    _check(_backend(checked=True, schedule="random"), 1, 2, 2, 200, 260, 128, True,
           dtype=BF16, seed=9, opts=dict(window=(70, -1)))
    _packed_check(_backend(checked=True, schedule="random"), [30, 100], [50, 70], 2, 1, 64,
                  True)   # packed sequences, blocks past a sequence's end
    every = ["window", "softcap", "alibi", "bias", "mask", "dropout"]   # and every variant
    _check(_backend(checked=True, schedule="random"), 1, 2, 1, 37, 75, 128, True, seed=6,
           opts=variant_options(every, F16, (1, 2, 1, 37, 75, 128)))


def _packed_check(backend, lens_q, lens_k, Hq, Hkv, D, causal, dtype=F16, opts=None):
    """kernel_backward.backward over packed sequences: each sequence's dQ, dK, dV within
    the rule against its own float64 reference."""
    from cuflash.backends.kernel_forward import Segments
    opts = opts or {}
    scale = D ** -0.5
    seqs = []
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        q, k, v, do = attention_inputs(1, Hq, Hkv, nq, nk, D, dtype, seed=b)
        o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                           return_lse=True, **opts)
        seqs.append((do, q, k, v, o.astype(dtype), lse.astype(np.float32)))
    packed = [np.concatenate(xs, axis=2) for xs in zip(*seqs)]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    xp = backend.xp
    segments = Segments(batch=len(lens_q), max_q=max(lens_q), max_k=max(lens_k),
                        cu_q=xp.asarray(cu_q), cu_k=xp.asarray(cu_k))
    grads = kernel_backward.backward(backend, *map(xp.asarray, packed), causal=causal,
                                     scale=scale, segments=segments,
                                     variants=variants_of(opts, xp) if opts else None)
    grads = [to_host(g) for g in grads]
    for b, seq in enumerate(seqs):
        ref = reference.attention_backward(*seq, causal=causal, scale=scale, **opts)
        plain = plain_backward(*seq, causal=causal, scale=scale, dtype=dtype, **opts)
        for name, g, r, p, cu in zip(("dq", "dk", "dv"), grads, ref, plain, (cu_q, cu_k, cu_k)):
            assert_close_to_reference(g[:, :, cu[b]:cu[b + 1]], r, p, dtype, factor=3.0,
                                      what=f"{name} of sequence {b}")


@pytest.mark.parametrize("causal,opts", [(False, None), (True, None),
                                         (True, dict(window=(60, -1), softcap=0.7))])
def test_packed_sequences(causal, opts):
    """Packed sequences (varlen): each block reads its own sequence's rows at its offset
    (the boxes' rows past its end, the next sequence's, masked), blocks past a sequence's
    end return at once, lse and D gathered by batch row for the dK/dV pass's TMA; lengths
    that cross tiles, one of a single row, a sequence with more keys than queries."""
    be = emulator_backend("sm_90a")
    _packed_check(be, [70, 200, 1, 130], [90, 150, 64, 130], 4, 2, 64, causal, opts=opts)
    assert [p.kernel for p in be.take_launches()] == [
        "flash_bwd_preprocess", "flash_bwd_dkdv_sm90", "flash_bwd_dq_sm90"]


@pytest.mark.parametrize("D,schedule,dt,workers", [(64, "reversed", F16, 8),
                                                    (128, "random", BF16, 8),
                                                    (128, "reversed", F16, 0)])
def test_checked_and_schedules(D, schedule, dt, workers):
    """No hazard of any kind the emulator checks, and the bits of round-robin."""
    args = (1, 4, 2, 130, 140, D, True)
    grads = _check(_backend(checked=True, schedule=schedule), *args, dtype=dt, seed=D,
                   dq_workers=workers)
    grads_rr = _check(_backend(), *args, dtype=dt, seed=D, dq_workers=workers)
    for x, y in zip(grads, grads_rr):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("units,N,workers", [
    # (tile-times: the 5-GEMM walks' + the partials' memory, against the two passes')
    (16, 16384, 8),   # 128 blocks, one wave of 16 key blocks: 11.5 + 2.3, against 16
    (16, 1024, 0),    # 0.72 + 2.3 against one wave of the two passes
    (16, 4096, 0),    # 2.9 + 2.3 against 4
    (64, 4096, 2),    # 11.5 + 2.3 against 16
    (256, 4096, 1),   # two waves of 32: 46 + 4.7 against 63
    (256, 1024, 0),   # 11.5 + 4.7 against 16
    (1, 1024, 8),     # one head: a worker per key block, one wave either way
    (1, 16384, 0),    # one head, 128 key blocks: the two passes' 128 blocks, one wave
])
def test_the_worker_model(units, N, workers):
    """Five GEMMs or two passes on an H100 (132 SMs), by the tile-times of
    `tiling.dq_workers` with the Hopper tile cost and its partials' memory
    (docs/kernels.md): workers per (batch, K/V head), 0 for the two passes."""
    be = kernels.emulator_backend(arch="sm_90a")
    assert be.limits()["sm_count"] == 132
    pair = tiling.sm90_bwd_plans("float16", 128)
    plans, w = sm90_bwd.five_gemm_pair(be, pair, units=units, Nk=N)
    assert w == workers and plans == (tiling.sm90_dq_parts_plans("float16", 128) if w else pair)
    # not deterministic: a block per key block; a count asked for, at most the key blocks
    assert sm90_bwd.five_gemm_pair(be, pair, units=units, Nk=N, deterministic=False)[1] == N // 128
    assert sm90_bwd.five_gemm_pair(be, pair, units=units, Nk=N, dq_workers=3)[1] == 3
    assert sm90_bwd.five_gemm_pair(be, pair, units=units, Nk=N, dq_workers=0) == (pair, 0)


@pytest.mark.parametrize("D,workers", [(64, 1), (128, 2), (64, 3)])
def test_workers_walk_key_blocks(D, workers):
    """Five GEMMs with fewer workers than key blocks (5 of 128 keys): each block walks key
    blocks w, w + W, .., reloading K_j, V_j once the consumers freed them and carrying the
    ring on; each warpgroup's partial takes its key blocks' parts in order. Within the rule,
    no hazard in checked mode, the bits of round-robin under a random schedule."""
    args = (1, 4, 2, 200, 600, D, True)
    grads = _check(_backend(checked=True, schedule="random"), *args, seed=D + workers,
                   dq_workers=workers)
    grads_rr = _check(_backend(), *args, seed=D + workers, dq_workers=workers)
    for x, y in zip(grads, grads_rr):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


def test_the_whole_backward_with_it():
    """kernel_backward.backward on sm_90a: the preprocess, then the Hopper kernels (here the
    five GEMMs: the worker model gives 2 workers of one key block), each gradient within
    the rule; the calls they do not take run the mma.sync kernels."""
    from cuflash.variants import Variants
    be = emulator_backend("sm_90a")
    (do, q, k, v, o, lse), scale = backward_inputs(2, 4, 2, 150, 200, 64, F16, causal=True, seed=5)
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale)
    hopper = ["flash_bwd_preprocess", *FIVE_GEMMS]
    assert [p.kernel for p in be.take_launches()] == hopper
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=True, scale=scale, dtype=F16)
    for name, out, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert_close_to_reference(out, r, p, F16, factor=3.0, what=name)
    kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                             variants=Variants(window=(50, 0)))   # the window alone: Hopper
    assert [p.kernel for p in be.take_launches()] == hopper
    mma_sync = ["flash_bwd_preprocess", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc"]
    kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                             variants=Variants(softcap=3.0))   # any variant: Hopper
    assert [p.kernel for p in be.take_launches()] == hopper
    for call in (dict(dq_workers=0), dict(scale=-scale)):
        kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, **{"scale": scale, **call})
        assert list(dict.fromkeys(p.kernel for p in be.take_launches())) == mma_sync, call
    padded = np.zeros(do.shape[:-1] + (72,), F16)[..., :64]   # dO's rows 144 bytes apart:
    padded[...] = do                                          # TMA reads them in place
    grads_padded = kernel_backward.backward(be, padded, q, k, v, o, lse, causal=True, scale=scale)
    assert [p.kernel for p in be.take_launches()] == hopper
    for x, y in zip(grads, grads_padded):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))
    (p_kv, p_q), why = tiling.backward_path(96, "float16", (9, 0), max_smem=232448, sm90a=True,
                                            plain=True)
    assert p_kv.kernel == "flash_bwd_dkdv_tc" and "d = 64 or 128" in why
    (p_kv, p_q), why = tiling.backward_path(128, "bfloat16", (9, 0), max_smem=232448,
                                            sm90a=True, plain=True)
    assert (p_kv.kernel, p_q.kernel) == ("flash_bwd_dkdv_sm90", "flash_bwd_dq_sm90")
    assert "wgmma on sm_90a" in why
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    with pytest.raises(ValueError, match="sm_90a"):
        sm90_bwd.backward_sm90(kernels.emulator_backend(arch="sm_90"), do, q, k, v, lse, Dvec,
                               causal=True, scale=scale)
    f32 = [x.astype(np.float32) for x in (do, q, k, v)]   # the forward's one-pass tf32 only
    with pytest.raises(TypeError, match=r"the Hopper backward takes float16 or bfloat16, q, k, "
                                        r"v alike; got float32"):
        sm90_bwd.backward_sm90(be, *f32, lse, Dvec, causal=True, scale=scale)
    kernel_backward.backward(be, *f32, o.astype(np.float32), lse, causal=True, scale=scale,
                             allow_tf32=True)
    assert list(dict.fromkeys(p.kernel for p in be.take_launches())) == [
        "flash_bwd_preprocess", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc"]


@pytest.mark.parametrize("dt,D", [(F16, 64), (BF16, 128)], ids=["float16-D64", "bfloat16-D128"])
def test_not_deterministic_adds_dq_by_atomics(dt, D):
    """deterministic=False: five GEMMs, a block per key block, all adding dQ's parts into
    one float32 partial by bulk reduce-adds (D = 128: two halves of 64 columns); dq within the
    rule, dk and dv the deterministic run's bits, no hazard in checked mode under a random
    schedule (each warpgroup's dSᵀ written, fenced and met on before its dQ product; its
    dQ part fenced and met on before the add, written again only once the add read it).
    dbias with a query axis (the dQ pass writes it) keeps both passes."""
    from cuflash.variants import Variants
    be = emulator_backend("sm_90a", checked=True, schedule="random")
    (do, q, k, v, o, lse), scale = backward_inputs(2, 4, 2, 150, 200, D, dt, causal=True, seed=5)
    fast = kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                                    deterministic=False)
    assert [p.kernel for p in be.take_launches()] == ["flash_bwd_preprocess", *FIVE_GEMMS]
    same = kernel_backward.backward(emulator_backend("sm_90a"), do, q, k, v, o, lse, causal=True,
                                    scale=scale)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=True, scale=scale, dtype=dt)
    for name, out, r, p in zip(("dq", "dk", "dv"), fast, ref, plain):
        assert_close_to_reference(out, r, p, dt, factor=3.0, what=name)
    for x, y in zip(fast[1:], same[1:]):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))
    bias = np.random.default_rng(1).uniform(-1, 1, (2, 4, 150, 200)).astype(np.float32)
    kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                             variants=Variants(bias=bias), return_dbias=True, deterministic=False)
    assert [p.kernel for p in be.take_launches()] == ["flash_bwd_preprocess", *TWO_PASSES]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_not_deterministic_on_the_gpu(D, causal):
    """The five-GEMM pass on an H100 (dQ by bulk reduce-adds): dq within the rule, dk and
    dv the two-pass run's bits."""
    import cupy
    be = hopper_gpu_backend()
    (do, q, k, v, o, lse), scale = backward_inputs(2, 8, 2, 700, 900, D, F16, causal=causal,
                                                   seed=3)
    fast, same = (kernel_backward.backward(be, *map(cupy.asarray, (do, q, k, v, o, lse)),
                                           causal=causal, scale=scale, deterministic=det)
                  for det in (False, True))
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=F16)
    for name, out, r, p in zip(("dq", "dk", "dv"), fast, ref, plain):
        assert_close_to_reference(cupy.asnumpy(out), r, p, F16, factor=3.0, what=name)
    for x, y in zip(fast[1:], same[1:]):
        np.testing.assert_array_equal(cupy.asnumpy(x).view(np.uint16),
                                      cupy.asnumpy(y).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu(dt, D, causal):
    """The same launches on an H100: the driver's tensor maps, NVRTC for sm_90a."""
    be = hopper_gpu_backend()
    for workers in (None, 0, 3):
        _check(be, 2, 8, 2, 700, 900, D, causal, dtype=dt, seed=D, dq_workers=workers)
    _check(be, 1, 4, 2, 900, 700, D, causal, dtype=dt, seed=D + 1, opts=dict(window=(200, 30)))
    _packed_check(be, [700, 300, 1], [900, 200, 64], 8, 2, D, causal, dtype=dt)
