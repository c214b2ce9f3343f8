"""The tensor-core backward (flash_bwd_tc.cu) in the emulator, on every emulated tensor-core
arch, against the float64 reference backward with FlashAttention's rule for gradients
(conftest.assert_close_to_reference with factor 3 over a plain 16-bit backward); its
dispatch (`tiling.backward_path`); its machine code. Each run asserts the kernels that
launched. (Its shared-memory formula: test_kernels_forward.py's
test_smem_formula_matches_ptxas.)

Each (dtype, head dim, shared memory) picks the 5-GEMM pair where it applies (dK/dV with
dQ partials, their sum: the default for 16-bit d <= 128) and the two-kernel pair (dK/dV,
dQ); each is built once per arch it runs on (a g++ build of a few seconds), so the matrix
runs every specialization on an sm_80+ arch (the tiles sized for sm_75 through a backend
whose max_smem is 64 KB), every float16 one that fits sm_75 there too (two m16n8k8 per k16
step, synchronous copies), Blackwell's too, and reuses those builds for the features
(causal, GQA/MQA, Nq != Nk, odd sizes, fully masked rows, strides), for 128 < d <= 256,
where the dK/dV blocks own 128-column chunks of dK, dV, and for the workers of the 5-GEMM
backward, each partial checked against its own key blocks.
"""
import numpy as np
import pytest

from cuflash import _dtypes, compiler, reference, tiling
from cuflash.backends import kernel_backward, kernel_forward, kernels

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, backward_inputs,
                      emulator_backend, have_toolchain, plain_backward, round_to)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F16, BF16, F32 = np.dtype(np.float16), _dtypes.BFLOAT16, np.dtype(np.float32)
TC_BWD = set(tiling.TC_BWD_KERNELS)                 # two kernels: dK/dV, then dQ
TC_BWD5 = {"flash_bwd_dkdv_tc", "flash_bwd_dq_sum"}  # 5 GEMMs: dK/dV with dQ's partials, their sum


def _backend(arch, *, checked=False, schedule="round-robin", max_smem=None):
    """The emulator on `arch`; `max_smem` below the arch's limit makes its plans pick the
    smaller tiles (an sm_80+ run of the tiles sized for sm_75)."""
    return emulator_backend(arch, max_smem=max_smem, checked=checked, schedule=schedule, seed=5)


def _problem(B, Hq, Hkv, Nq, Nk, d, dtype, causal, seed=0):
    """[do, q, k, v, o, lse], scale (conftest.backward_inputs): the errors measured are the
    backward's own."""
    return backward_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, causal=causal, seed=seed)


def _check(be, args, scale, *, causal, expect=None, dq_workers=None, deterministic=True):
    """The backward on `be` (a conftest.emulator_backend), each gradient within the
    FlashAttention rule; returns the kernels launched after the preprocess (the plans
    `expect` when given), dq, dk, dv. `dq_workers`, `deterministic` as
    kernel_backward.backward takes them (dq_workers 0: the two-kernel backward)."""
    do, q, k, v, o, lse = args
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=causal, scale=scale,
                                     dq_workers=dq_workers, deterministic=deterministic)
    pre, *plans = be.take_launches()
    assert pre.kernel == "flash_bwd_preprocess" and len(plans) == 2, plans
    if expect is not None:
        assert tuple(plans) == expect, plans
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=q.dtype)
    for name, out, r, p, like in zip(("dq", "dk", "dv"), grads, ref, plain, (q, k, v)):
        assert out.shape == like.shape and out.dtype == like.dtype, name
        assert_close_to_reference(out, r, p, q.dtype, factor=3.0, what=f"{name} ({plans[0]})")
    return {p.kernel for p in plans}, grads


def _plans(dtype, D, arch, max_smem=None, dq_parts=True):
    """The plans for bucket D on `arch` within `max_smem`, else within `arch`'s limit: the
    5-GEMM pair where it applies (`dq_parts`), else (dK/dV, dQ), each kernel's first
    candidate that fits."""
    limits = kernels.emulator_limits(arch)
    if max_smem is None:
        max_smem = limits["max_smem"]
    return tiling.backward_path(D, dtype, limits["cc"], max_smem=max_smem,
                                dq_parts=dq_parts)[0]


# -- every specialization, on the archs it targets --------------------------------------------
SM75_SMEM = 64 * 1024  # on an sm_80+ arch: the tiles sized for sm_75's limit
SPECS = [(F16, 64, "sm_75", None), (F16, 128, "sm_75", None), (F16, 64, "sm_80", None),
         (F16, 128, "sm_89", None), (BF16, 64, "sm_86", None), (BF16, 128, "sm_90", None),
         (F16, 64, "sm_89", None),
         (F16, 128, "sm_80", None), (BF16, 128, "sm_86", None), (BF16, 64, "sm_90", None),
         (F16, 128, "sm_90", None),
         # Blackwell runs the mma.sync kernels: sm_100 the 227 KB tiles, sm_120 the 99 KB ones
         (F16, 128, "sm_100", None), (BF16, 64, "sm_100", None), (F16, 128, "sm_120", None),
         (BF16, 64, "sm_120", None),
         # D = 256: the dK/dV blocks own 128-column chunks of dK, dV
         (F16, 256, "sm_75", None), (F16, 256, "sm_80", None), (F16, 256, "sm_89", None),
         (F16, 256, "sm_80", SM75_SMEM), (BF16, 256, "sm_90", None), (BF16, 256, "sm_86", None),
         (BF16, 256, "sm_80", SM75_SMEM)]


def test_the_matrix_covers_every_specialization_and_arch():
    built = {(p, arch) for dt, D, arch, smem in SPECS for parts in (True, False)
             for p in _plans(dt, D, arch, smem, parts)}
    sm75 = set(tiling.all_tc_bwd_plans((7, 5)))
    sm80 = set(tiling.all_tc_bwd_plans((8, 0))) | set(tiling.all_tc_bwd_plans((9, 0)))
    for plan in tiling.all_tc_bwd_plans():
        archs = {a for p, a in built if p == plan}
        if plan in sm80:
            assert archs - {"sm_75"}, f"{plan} never runs on an sm_80+ arch"
        if plan.dtype == "float16" and plan.smem_bytes <= SM75_SMEM and plan in sm75:
            assert "sm_75" in archs, f"{plan} never runs with m16n8k8 (sm_75)"
    assert {a for _, a in built} == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100",
                                     "sm_120"}


@pytest.mark.parametrize("dt,D,arch,smem", SPECS, ids=lambda x: getattr(x, "name", str(x)))
def test_specialization(dt, D, arch, smem):
    """Causal with Nq < Nk, partial key and query tiles, head-dim columns d..D-1 padded;
    then the full-width head dim without the mask."""
    be = _backend(arch, max_smem=smem)
    expect, two = _plans(dt, D, arch, smem), _plans(dt, D, arch, smem, dq_parts=False)
    args, scale = _problem(1, 2, 1, 37, 2 * 64 + 3, D - 8, dt, True, seed=D)
    kinds = _check(be, args, scale, causal=True, expect=expect, dq_workers=2)[0]
    assert kinds == (TC_BWD5 if expect[0].dq_parts else TC_BWD)
    if expect != two:  # and the two-kernel backward of the same tile size
        assert _check(be, args, scale, causal=True, expect=two, dq_workers=0)[0] == TC_BWD
    args, scale = _problem(1, 1, 1, 70, 17, D, dt, False, seed=D + 1)
    _check(be, args, scale, causal=False, expect=expect, dq_workers=1)


# -- 128 < d <= 256: head-dim chunks of dK, dV ----------------------------------------------

@pytest.mark.parametrize("arch,dt,smem,Hq,Hkv,Nq,Nk,d,causal", [
    # d = 136: the second chunk holds 8 columns; GQA, Nq < Nk
    ("sm_75", F16, None, 4, 2, 45, 70, 136, True),
    ("sm_80", F16, None, 4, 2, 45, 70, 136, True),
    # d = 200, not a bucket; GQA with Nq > Nk: the first rows see no key
    ("sm_89", F16, None, 6, 2, 113, 40, 200, True),
    ("sm_80", F16, SM75_SMEM, 6, 2, 113, 40, 200, True),
    # d = 192, MQA, not causal; the sm_75-sized tiles on sm_80
    ("sm_80", BF16, SM75_SMEM, 3, 1, 70, 53, 192, False),
    ("sm_90", BF16, None, 3, 1, 70, 53, 192, False),
    # d = 256, ragged Nq != Nk, several key blocks and query tiles
    ("sm_75", F16, None, 2, 1, 33, 97, 256, True),
    ("sm_86", BF16, None, 2, 2, 97, 81, 256, True),
])
def test_head_dims_above_128(arch, dt, smem, Hq, Hkv, Nq, Nk, d, causal):
    """The chunked dK/dV plan (every chunk of dK, dV written: the columns beyond the first
    chunk are judged as the first) and the 256-wide dQ, against the float64 gradients."""
    be = _backend(arch, max_smem=smem)
    args, scale = _problem(2, Hq, Hkv, Nq, Nk, d, dt, causal, seed=Nq + Nk + d)
    plans, why = tiling.backward_path(d, dt, be.limits()["cc"], max_smem=be.limits()["max_smem"])
    assert plans == _plans(dt, 256, arch, smem) and plans[0].num_d_chunks(d) == 2, why
    assert "5 GEMMs" not in why  # chunked: the two-kernel backward
    assert "2 head-dim chunks of 128" in why
    kinds, (dq, dk, dv) = _check(be, args, scale, causal=causal, expect=plans)
    assert kinds == TC_BWD
    if causal and Nq > Nk:  # rows that see no key: zero dQ
        assert np.all(dq[..., :Nq - Nk, :].astype(np.float64) == 0)


# -- features on the default tile of each arch -----------------------------------------------

@pytest.mark.parametrize("arch,dt", [("sm_75", F16), ("sm_90", BF16)])
@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,d,causal", [
    (4, 1, 33, 47, 64, False),     # MQA: each dK/dV block sums over 4 query heads
    (6, 2, 113, 17, 56, True),     # GQA; Nq > Nk: the first 96 rows see no key (lse = −inf)
    (2, 2, 1, 150, 8, True),       # decoding: one query, the smallest d
    (1, 1, 150, 113, 40, True),    # odd sizes, several query and key blocks
])
def test_features(arch, dt, Hq, Hkv, Nq, Nk, d, causal):
    args, scale = _problem(2, Hq, Hkv, Nq, Nk, d, dt, causal, seed=Nq * Nk + d)
    kinds, (dq, dk, dv) = _check(_backend(arch), args, scale, causal=causal)
    assert kinds in (TC_BWD, TC_BWD5)
    for g in (dq, dk, dv):
        assert not np.isnan(g.astype(np.float64)).any()
    if causal and Nq > Nk:  # rows that see no key: zero dQ (and nothing added to dK, dV)
        assert np.all(dq[..., :Nq - Nk, :].astype(np.float64) == 0)


def test_strided_inputs_aligned_and_not():
    """Views with 16-byte rows run on tensor cores; dO two bytes off falls back to SIMT;
    both are right."""
    args, scale = _problem(1, 2, 2, 37, 45, 48, F16, True, seed=9)
    do, q, k, v, o, lse = args
    q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # (B, N, H, d) memory
    wide = np.zeros(k.shape[:-2] + (2 * k.shape[-2], k.shape[-1]), F16)
    wide[:, :, ::2] = k
    k = wide[:, :, ::2]                                                          # row stride 2d
    be = _backend("sm_80")
    assert kernel_forward.loads_16b_aligned(q, k, v, do)
    assert _check(be, [do, q, k, v, o, lse], scale, causal=True, dq_workers=2)[0] == TC_BWD5
    buf = np.zeros(do.size + 1, F16)
    do_off = buf[1:].reshape(do.shape)
    do_off[...] = do
    assert not kernel_forward.loads_16b_aligned(q, k, v, do_off)
    kinds = _check(be, [do_off, q, k, v, o, lse], scale, causal=True)[0]
    assert not kinds & (TC_BWD | TC_BWD5)


# -- checked mode: no races, no out-of-bounds access, no read of a pending cp.async ----------

@pytest.mark.parametrize("arch,dt,D,schedule,smem", [
    ("sm_80", F16, 64, "random", None),      # K_j, V_j fragments in registers
    ("sm_75", F16, 128, "reversed", None),   # synchronous copies, K_j, V_j re-read from smem
    ("sm_90", BF16, 128, "random", None),
    ("sm_90", BF16, 256, "reversed", None),  # two dK/dV blocks per key block (head-dim chunks)
    ("sm_80", F16, 256, "random", SM75_SMEM),  # one-warp dK/dV, two-warp dQ, rolled ring copies
])
def test_checked(arch, dt, D, schedule, smem):
    # GQA (the dK/dV ring runs across two query heads), Nq > Nk and causal: skipped,
    # partial and fully masked tiles; the rings wrap
    args, scale = _problem(1, 2, 1, 100, 70, D - 16, dt, True, seed=D)
    be = _backend(arch, checked=True, schedule=schedule, max_smem=smem)
    expect = _plans(dt, D, arch, smem)
    kinds, grads = _check(be, args, scale, causal=True, expect=expect, dq_workers=2)
    assert kinds == (TC_BWD5 if expect[0].dq_parts else TC_BWD)
    # one writer per element, a fixed order: the same bits as the round-robin schedule
    plain = kernel_backward.backward(_backend(arch, max_smem=smem), *args, causal=True,
                                     scale=scale, dq_workers=2)
    for name, x, y in zip(("dq", "dk", "dv"), grads, plain):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16)), name


# -- the 5-GEMM backward's workers and their partials of dQ ---------------------------------

def _partial_dq(do, q, k, v, o, lse, *, causal, scale, key_blocks, dtype=None):
    """dS K over the keys of `key_blocks` (a list of key ranges), unscaled, in float64: the
    partial of dQ a worker owning those key blocks adds up (FA2, Algorithm 2). `dtype`: the
    plain version, every input and dS stored in `dtype`."""
    r = (lambda x: x) if dtype is None else (lambda x: round_to(x, dtype))  # noqa: E731
    do, q, k, v, o = (r(a.astype(np.float64)) for a in (do, q, k, v, o))
    group = q.shape[1] // k.shape[1]
    k, v = (np.repeat(a, group, axis=1) for a in (k, v))
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        Nq, Nk = s.shape[-2:]
        s = np.where(np.arange(Nk)[None, :] > np.arange(Nq)[:, None] + (Nk - Nq), -np.inf, s)
    p = np.exp(s - lse.astype(np.float64)[..., None])
    ds = r(p * (do @ v.swapaxes(-1, -2) - (do * o).sum(-1, keepdims=True)))
    keys = np.zeros(k.shape[-2], bool)
    for lo, hi in key_blocks:
        keys[lo:hi] = True
    return ds[..., keys] @ k[..., keys, :]


@pytest.mark.parametrize("arch,dt,D,workers", [("sm_80", F16, 64, 2), ("sm_90", BF16, 128, 2),
                                               ("sm_75", F16, 64, 1)])
def test_each_worker_owns_its_key_blocks(arch, dt, D, workers):
    # GQA, causal, Nq != Nk, 3 or 5 key blocks over `workers` workers: worker w's partial is
    # dS K over key blocks w, w + W, ... alone, the gradients are right and their bits do
    # not depend on the block schedule
    args, scale = _problem(2, 4, 2, 90, 300, D - 8, dt, True, seed=workers)
    grads, parts = {}, {}
    for schedule in ("round-robin", "random"):
        be = _backend(arch, schedule=schedule)
        get_function = be.get_function

        def keeping_the_partials(plan, mods=None, get_function=get_function):
            fn = get_function(plan, mods)   # flash_bwd_dq_sum: a copy of the partials it is given
            if not isinstance(plan, tiling.DqSumPlan):
                return fn
            return lambda grid, block, a, **kw: (parts.update(w=a[0].copy()),
                                                  fn(grid, block, a, **kw))[1]
        be.get_function = keeping_the_partials
        lim = be.limits()
        (dkdv, _), _ = tiling.backward_path(D, dt, lim["cc"], max_smem=lim["max_smem"])
        assert -(-300 // dkdv.block_rows) > workers   # a worker walks several key blocks
        kinds, grads[schedule] = _check(be, args, scale, causal=True, dq_workers=workers)
        # rows of HEAD_DIM floats, 90 rows padded to whole tiles; the padding stays zero
        rows_pad = -(-90 // dkdv.tile_rows) * dkdv.tile_rows
        assert kinds == TC_BWD5 and parts["w"].shape == (workers, 2, 4, rows_pad, D)
        assert not parts["w"][..., 90:, :].any() and not parts["w"][..., D - 8:].any()
    for w in range(workers):
        mine = [(n, n + dkdv.block_rows) for n in range(w * dkdv.block_rows, 300,
                                                           workers * dkdv.block_rows)]
        ref, plain = (_partial_dq(*args, causal=True, scale=scale, key_blocks=mine, dtype=x)
                      for x in (None, dt))
        assert_close_to_reference(parts["w"][w][..., :90, :D - 8], ref, plain, dt, factor=3.0,
                                  what=f"partial {w}")
    for name, x, y in zip(("dq", "dk", "dv"), *grads.values()):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16)), name


@pytest.mark.parametrize("arch,dt,D", [("sm_80", F16, 64), ("sm_90", BF16, 128)])
def test_not_deterministic_adds_dq_by_atomics(arch, dt, D):
    """deterministic=False: FlashAttention-2's grid, a block per key block, every block
    adding dS K_j into one float32 dQ by atomics (one partial, not one per worker): dq within
    the rule, dk and dv the deterministic run's bits; no race in checked mode under a random
    schedule (the additions are atomic)."""
    args, scale = _problem(2, 4, 2, 90, 300, D - 8, dt, True, seed=3)
    be = _backend(arch, checked=True, schedule="random")
    get_function, seen = be.get_function, {}

    def keeping_the_launches(plan, mods=None):
        fn = get_function(plan, mods)
        return lambda grid, block, a, **kw: (seen.setdefault(plan.kernel, (grid, a[0].shape)),
                                              fn(grid, block, a, **kw))[1]
    be.get_function = keeping_the_launches
    kinds, (dq, dk, dv) = _check(be, args, scale, causal=True, deterministic=False)
    (dkdv, _), _ = tiling.backward_path(D, dt, be.limits()["cc"], max_smem=be.limits()["max_smem"])
    assert kinds == TC_BWD5
    assert seen["flash_bwd_dkdv_tc"][0][0] == -(-300 // dkdv.block_rows)   # a block per key block
    assert seen["flash_bwd_dq_sum"][1][0] == 1                             # one partial
    _, (dq_d, dk_d, dv_d) = _check(_backend(arch), args, scale, causal=True, dq_workers=2)
    for x, y in ((dk, dk_d), (dv, dv_d)):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("workers", [None, 1, 3, 0], ids=["default", "w1", "w3", "two-kernels"])
@pytest.mark.parametrize("dt", [F16, BF16])
def test_cuda_backward_both_ways_right_and_bitwise_reproducible(dt, workers):
    # the real GPU's red.add and block order: every worker count gives the float64
    # reference's gradients, and three calls the same bits
    import cupy
    from cuflash.backends.kernels import cuda_backend
    be = cuda_backend()
    args, scale = _problem(2, 4, 2, 300, 700, 64, dt, True, seed=11)
    runs = [kernel_backward.backward(be, *map(cupy.asarray, args), causal=True, scale=scale,
                                     dq_workers=workers) for _ in range(3)]
    ref = reference.attention_backward(*args, causal=True, scale=scale)
    plain = plain_backward(*args, causal=True, scale=scale, dtype=dt)
    for i, name in enumerate(("dq", "dk", "dv")):
        first = cupy.asnumpy(runs[0][i])
        assert_close_to_reference(first, ref[i], plain[i], dt, factor=3.0, what=name)
        for other in runs[1:]:
            assert np.array_equal(first.view(np.uint16), cupy.asnumpy(other[i]).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("dt", [F16, BF16])
def test_cuda_backward_not_deterministic(dt):
    # the real GPU's atomics from a block per key block: dq within the rule, dk and dv the
    # deterministic backward's bits (a worker count keeps both on mma.sync, sm_90a too)
    import cupy
    from cuflash.backends.kernels import cuda_backend
    be = cuda_backend()
    args, scale = _problem(2, 4, 2, 300, 700, 64, dt, True, seed=11)
    fast, same = (kernel_backward.backward(be, *map(cupy.asarray, args), causal=True, scale=scale,
                                           dq_workers=2, deterministic=det)
                  for det in (False, True))
    ref = reference.attention_backward(*args, causal=True, scale=scale)
    plain = plain_backward(*args, causal=True, scale=scale, dtype=dt)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close_to_reference(cupy.asnumpy(fast[i]), ref[i], plain[i], dt, factor=3.0,
                                  what=name)
    for i in (1, 2):
        assert np.array_equal(cupy.asnumpy(fast[i]).view(np.uint16),
                              cupy.asnumpy(same[i]).view(np.uint16))


def test_dq_workers_rule():
    # up to ⌈SMs / units⌉ workers (at most the key blocks and DQ_PARTS_MAX), the fewest
    # whose waves of one block per SM take the least time; with five GEMMs' worth of a
    # two-kernel tile's seven (tile_cost 5/7):
    def w(units, key_blocks, sm_count=132):
        return tiling.dq_workers(units, key_blocks, sm_count, tile_cost=5 / 7)
    assert w(16, 64) == 8 and w(16, 128) == 8   # 9: 144 blocks, two waves
    assert w(64, 32) == 2                       # 3: 192 blocks
    assert w(200, 64) == 1
    assert w(4, 3) == 3                         # both fill as little
    assert w(9, 64) == 13                       # 5 tiles each
    assert w(8, 64) == 16                       # 97% of the SMs
    assert w(1, 256) == 0                       # 16 blocks: 12%
    assert w(4, 256) == 0                       # 64 blocks: 48%
    assert w(6, 256) == 16                      # 96 blocks: 73%
    assert w(4, 64, None) == 0
    # at the H100's measured cost (a 5-GEMM tile as long as two kernels' 7 GEMMs) the
    # two kernels' finer blocks never take more waves: they run
    assert tiling.DQ_PARTS_TILE_COST == 1.0
    assert all(tiling.dq_workers(u, kb, 132) == 0 for u in (1, 9, 16, 64, 200) for kb in (3, 64, 256))


def test_dbias_and_float32_take_two_kernels():
    be = _backend("sm_80")
    args, scale = _problem(1, 2, 1, 40, 70, 32, F32, True, seed=4)
    assert _check(be, args, scale, causal=True)[0] == TC_BWD
    from cuflash.variants import Variants
    args, scale = _problem(1, 2, 1, 40, 70, 32, F16, False, seed=4)
    do, q, k, v, o, lse = args
    bias = np.zeros((1, 2, 40, 70), np.float32)
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=False, scale=scale,
                                     variants=Variants(bias=bias), return_dbias=True)
    assert {p.kernel for p in be.take_launches()[1:]} == TC_BWD and len(grads) == 4


# -- dispatch ---------------------------------------------------------------------------------

def test_backward_path_and_its_reasons():
    big = 227 * 1024

    def path(d=64, dtype=F16, cc=(8, 0), aligned=True, max_smem=big, dq_parts=False):
        return tiling.backward_path(d, dtype, cc, aligned, max_smem=max_smem, dq_parts=dq_parts)

    # the default 16-bit backward up to d = 128: 5 GEMMs (but Turing's D = 128)
    for dt, cc in ((F16, (7, 5)), (F16, (9, 0)), (BF16, (8, 6)), (BF16, (12, 0))):
        for d in (8, 64, 72, 128, 136, 256):
            (dkdv, dq), why = path(d, dt, cc, dq_parts=True)
            five = d <= 64 or (d <= 128 and cc != (7, 5))
            assert dkdv.dq_parts == five and isinstance(dq, tiling.DqSumPlan) == five, why
            assert ("5 GEMMs" in why) == five and d <= dkdv.head_dim, why
    # no 5-GEMM float32 backward
    assert not path(64, F32, (8, 0), dq_parts=True)[0][0].dq_parts

    for dt, cc in ((F16, (7, 5)), (F16, (9, 0)), (BF16, (8, 6))):
        for d in (8, 64, 72, 128, 136, 200, 256):
            plans, why = path(d, dt, cc)
            assert [p.kernel for p in plans] == list(tiling.TC_BWD_KERNELS), why
            assert all(d <= p.head_dim for p in plans) and "tensor cores" in why
            # above 128 the dK/dV blocks own chunks of 128 columns, dQ's all 256
            assert [p.num_d_chunks(d) for p in plans] == ([2, 1] if d > 128 else [1, 1]), why
            assert ("2 head-dim chunks of 128" in why) == (d > 128), why
    # the largest tile that fits: 8 warps in 163 KB, 4 in 99 KB, 1 (dK/dV) and 2 (dQ) in 64 KB
    for smem, warps in ((163 * 1024, [8, 8]), (99 * 1024, [4, 4]), (64 * 1024, [1, 2])):
        plans, why = path(256, max_smem=smem)
        assert [p.num_warps for p in plans] == warps and "tensor cores" in why, why
    assert "m16n8k8" in path(cc=(7, 5))[1] and "m16n8k16" in path(cc=(8, 0))[1]
    fallbacks = [
        (path(dtype=F32, cc=(7, 5)), "tf32"),
        (path(dtype=np.float64), "float64"),
        (path(cc=(7, 0)), "sm_70"),
        (path(dtype=BF16, cc=(7, 5)), "sm_80"),
        (path(d=60), "multiple of 8"),
        (path(d=264), "> 256"),
        (path(d=200, max_smem=60 * 1024), "fits"),
        (path(aligned=False), "16-byte aligned"),
        (path(cc=None), "unknown"),
        (path(d=128, max_smem=60 * 1024), "fits"),
    ]
    for (plans, why), word in fallbacks:
        assert not {p.kernel for p in plans} & TC_BWD and why.startswith("SIMT") and word in why, why
    # every emulated tensor-core arch takes the tensor-core backward for float16 by default,
    # up to d = 256
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90"):
        lim = kernels.emulator_limits(arch)
        for d in (64, 256):
            plans = path(d, F16, lim["cc"], max_smem=lim["max_smem"], dq_parts=True)[0]
            assert {p.kernel for p in plans} == (TC_BWD5 if d == 64 else TC_BWD), (arch, d)


def test_tc_bwd_plans_fit_and_are_listed():
    """Every plan is compiled by the gate and fits some arch; each (kernel, dtype, D) has a
    tile within sm_75's 64 KB; the chunks tile the head dim."""
    specs = tiling.specializations()["flash_bwd_tc.cu"]
    t4 = kernels.emulator_limits("sm_75")["max_smem"]
    h100 = kernels.emulator_limits("sm_90")["max_smem"]
    smallest = {}
    for plan in tiling.all_tc_bwd_plans():
        assert plan.name_expression in specs
        if isinstance(plan, tiling.DqSumPlan):
            continue
        assert plan.block_rows == 16 * plan.num_warps and plan.stages >= 2
        assert plan.tile_rows % 16 == 0 and plan.smem_bytes <= h100
        assert plan.chunk_cols % 16 == 0 and plan.head_dim % plan.chunk_cols == 0
        assert plan.chunked == (plan.chunk_cols < plan.head_dim)
        key = (plan.kernel, plan.dtype, plan.head_dim)
        smallest[key] = min(smallest.get(key, plan.smem_bytes), plan.smem_bytes)
    assert {D for _, _, D in smallest} == set(tiling.TC_BWD_HEAD_DIMS)
    assert all(b <= t4 for b in smallest.values()), smallest


# -- the machine code: tensor-core instructions present, local memory absent ----------------

@pytest.mark.skipif(not have_toolchain(), reason="NVRTC or ptxas not installed")
def test_sass_has_mma_ldmatrix_cp_async_and_no_local_memory():
    """nvdisasm of every specialization: all of the tile's mma (HMMA; twice as many on sm_75),
    ldmatrix (LDSM), cp.async (LDGSTS, sm_80+) and no local memory; bfloat16 and float32 on
    sm_75 are a trap. float32 (tf32): at least the unrolled P·X products' mma (S's k loop is
    rolled when the own operands stay in shared memory), no ldmatrix."""
    from cuflash import compile_gate
    if compile_gate.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    plans = {p.name_expression: p for p in (*tiling.all_tc_bwd_plans(),
                                             *tiling.all_tf32_bwd_plans())}
    archs = [a for a in compiler.GATE_ARCHS if a != "sm_70"]   # CUDA 13's nvdisasm has no sm_70
    # the file's list on each arch, as the gate builds it (its cached builds); together
    # every plan (the 5-GEMM D = 64 tiles are per arch: sm_80's spills on sm_75)
    rows = compile_gate.run_gate(archs=archs, sass=True, only=("flash_bwd_tc.cu",))
    assert len(rows) == sum(len(compile_gate.collect_specializations(a)["flash_bwd_tc.cu"])
                            for a in archs)
    assert {r.kernel for r in rows} <= set(plans)
    for r in rows:
        assert r.ok and r.sass is not None, (r.kernel, r.arch, r.error)
        p, n = plans[r.kernel], r.sass
        if isinstance(p, tiling.DqSumPlan):   # a sum: no mma, no local memory
            assert n["HMMA"] == n["LDL"] == n["STL"] == 0, (r.kernel, r.arch, n)
            continue
        if p.dtype in ("bfloat16", "float32") and r.arch == "sm_75":
            assert n["HMMA"] == n["LDSM"] == 0, (r.kernel, r.arch, n)
            continue
        if p.dtype == "float32":  # tf32: 32-bit shared loads, 3 mma per product when split
            x_mma = (p.tile_rows // 8) * (p.chunk_cols // 8) * (3 if p.split else 1)
            assert n["HMMA"] >= x_mma and n["LDSM"] == 0 and n["LDGSTS"] > 0, (r.kernel, r.arch, n)
            assert n["LDL"] == n["STL"] == 0, (r.kernel, r.arch, n)
            continue
        D, tr, cols = p.head_dim, p.tile_rows, p.chunk_cols
        s_mma = (D // 16) * (tr // 8)          # S (or Sᵀ): k16 steps x n-tiles
        x_mma = (tr // 16) * (cols // 8)       # P·X: k16 steps x n-tiles of one chunk
        ldsm_s = (D // 16) * (tr // 16)        # B fragments of S, one ldmatrix.x4 per 2 n-tiles
        ldsm_x = (tr // 16) * (cols // 16)
        if p.kernel == "flash_bwd_dkdv_tc":    # Sᵀ, dPᵀ, dV, dK; DQ_PARTS: dQ over the warps
            mma, ldsm = 2 * s_mma + 2 * x_mma, 2 * ldsm_s + 2 * ldsm_x
            if p.dq_parts:
                mma += tr * D * p.block_rows // (16 * 8 * 16) // p.num_warps
                ldsm += tr * D * p.block_rows // (16 * 16 * 16) // p.num_warps
        else:                                  # S, dP, dQ
            mma, ldsm = 2 * s_mma + x_mma, 2 * ldsm_s + ldsm_x
        ldsm += 2 * (D // 16)                  # the own operands' A fragments
        assert n["HMMA"] >= mma * (2 if r.arch == "sm_75" else 1), (r.kernel, r.arch, n)
        assert n["LDSM"] >= ldsm, (r.kernel, r.arch, n)
        assert (n["LDGSTS"] > 0) == (r.arch != "sm_75"), (r.kernel, r.arch, n)
        assert n["LDL"] == n["STL"] == 0, (r.kernel, r.arch, n)
