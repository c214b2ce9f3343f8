"""Which rows and keys a forward block owns (kernels/seqlens.cuh), in the emulator:
split-KV (the keys of each query block cut over several blocks, merged by lse), packed
variable-length batches and KV-cache lengths, on every FA2 forward kernel (SIMT float32
and float64, tensor-core float16 on sm_75 and sm_80, bfloat16, split tf32), each run
asserting the kernel that launched, against the float64 reference with the suite's
tolerance rule (conftest.error_bound); and the split count's rule.
"""
import numpy as np
import pytest

from cuflash import _dtypes, reference, tiling
from cuflash.backends import kernel_backward
from cuflash.backends.kernel_forward import Segments

from conftest import (HAS_GXX, assert_close_to_reference, assert_lse_close, emulator_backend,
                      error_bound, plain_attention, plain_backward)

F16, BF16, F32, F64 = (np.dtype(np.float16), _dtypes.BFLOAT16, np.dtype(np.float32),
                       np.dtype(np.float64))

# (dtype, arch, the kernel that must launch there)
KERNELS = [
    pytest.param(F32, "sm_70", "flash_fwd", id="simt-f32-sm70"),
    pytest.param(F64, "sm_80", "flash_fwd", id="simt-f64-sm80"),
    pytest.param(F16, "sm_75", "flash_fwd_tc", id="tc-f16-sm75"),
    pytest.param(F16, "sm_80", "flash_fwd_tc", id="tc-f16-sm80"),
    pytest.param(BF16, "sm_90", "flash_fwd_tc", id="tc-bf16-sm90"),
    pytest.param(F32, "sm_86", "flash_fwd_tc", id="tf32-f32-sm86"),
]

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")


def _inputs(shape_q, shape_k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_k))


def _check_against_reference(o, lse, q, k, v, *, causal, scale, what):
    if k.shape[2] == 0:  # no key: the contract's fully masked rows
        np.testing.assert_array_equal(o, 0, err_msg=what)
        np.testing.assert_array_equal(lse, -np.inf, err_msg=what)
        return
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                               return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    assert_close_to_reference(o, ref_o, plain, q.dtype, what=what)
    assert_lse_close(lse, ref_lse, q.dtype)


def _launched(be):
    """The one kernel `be` launched since the last call."""
    (plan,) = be.take_launches()
    return plan


# -- split-KV ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, arch, kernel", KERNELS)
def test_split_kv_matches_the_reference_for_every_split_count(dtype, arch, kernel):
    """One query block, 300 keys (several tiles): 1, 2, 3 and 7 splits (7 leaves some
    splits without a tile: O = 0, lse = −inf partials the merge must ignore), causal with
    Nq < Nk and not."""
    be = emulator_backend(arch)
    q, k, v = _inputs((1, 2, 24, 64), (1, 1, 300, 64), dtype)
    scale = 0.125
    for causal in (False, True):
        ref = reference.naive_attention(q, k, v, causal=causal, scale=scale)
        plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype)
        outs = {}
        for splits in (1, 2, 3, 7):
            o, lse = be.forward(q, k, v, causal=causal, scale=scale, num_splits=splits)
            assert _launched(be).kernel == kernel
            _check_against_reference(o, lse, q, k, v, causal=causal, scale=scale,
                                     what=f"O ({kernel}, {splits} splits, causal={causal})")
            outs[splits] = o.astype(np.float64)
        for splits in (2, 3, 7):  # the same up to rounding: within the bound on either's error
            diff = np.max(np.abs(outs[splits] - outs[1]))
            assert diff <= error_bound(ref, plain, dtype), (splits, diff)


@pytest.mark.parametrize("dtype, arch, kernel", [KERNELS[0], KERNELS[3]])
def test_split_kv_is_deterministic_under_any_schedule_and_checked(dtype, arch, kernel):
    """Bit-identical results for 3 splits under the round-robin, reversed and a random
    block schedule, with the race and bounds checks on (ragged sizes, GQA)."""
    q, k, v = _inputs((2, 4, 19, 40), (2, 2, 157, 40), dtype, seed=1)
    runs = []
    for schedule in ("round-robin", "reversed", "random"):
        be = emulator_backend(arch, checked=True, schedule=schedule, seed=5)
        runs.append(be.forward(q, k, v, causal=True, scale=0.2, num_splits=3))
        assert _launched(be).kernel == kernel
    _check_against_reference(*runs[0], q, k, v, causal=True, scale=0.2, what="O (3 splits)")
    for o, lse in runs[1:]:
        np.testing.assert_array_equal(o, runs[0][0])
        np.testing.assert_array_equal(lse, runs[0][1])


def test_the_launch_splits_the_keys_when_the_blocks_leave_sms_idle(monkeypatch):
    """forward() asks tiling.split_kv_count (one query block, one head, 2048 keys on 108
    SMs: a split) and launches blocks × splits; the merged result is the reference's."""
    be = emulator_backend("sm_80")
    q, k, v = _inputs((1, 1, 8, 32), (1, 1, 2048, 32), F16)
    grids, plans = [], []
    fn = be.get_function

    def spy(plan, mods=None):
        plans.append(plan)
        kernel = fn(plan, mods)

        def launch(grid, block, args, **kw):
            grids.append(grid[0])
            return kernel(grid, block, args, **kw)
        return launch

    monkeypatch.setattr(be, "get_function", spy)
    o, lse = be.forward(q, k, v, causal=False, scale=0.2)
    (plan,) = plans
    assert plan.kernel == "flash_fwd_tc"
    splits = tiling.split_kv_count(1, 2048 // plan.block_n, 108)
    assert splits > 1 and grids == [splits]
    _check_against_reference(o, lse, q, k, v, causal=False, scale=0.2, what="O (auto split)")


def test_split_kv_count_rule():
    # enough blocks to fill 80 % of the SMs: no split
    assert tiling.split_kv_count(87, 64, 108) == 1
    assert tiling.split_kv_count(200, 64, 108) == 1
    # never more splits than key tiles, SMs or MAX_SPLITS
    assert tiling.split_kv_count(1, 3, 108) == 3
    assert tiling.split_kv_count(1, 1, 108) == 1
    assert tiling.split_kv_count(1, 10_000, 1000) <= tiling.MAX_SPLITS
    # 16 blocks on 132 SMs, 64 tiles: 8 splits fill 128 of 132 SMs (efficiency 0.97);
    # 7 (112 blocks, 0.85) is the fewest within 0.85 of that best
    assert tiling.split_kv_count(16, 64, 132) == 7
    # unknown SM count: no split
    assert tiling.split_kv_count(1, 64, None) == 1


# -- packed variable-length batches and KV-cache lengths --------------------------------

def _packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed=2):
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((1, hq, cq[-1], d)).astype(dtype)
    k = rng.standard_normal((1, hkv, ck[-1], d)).astype(dtype)
    v = rng.standard_normal((1, hkv, ck[-1], d)).astype(dtype)
    return q, k, v, cq, ck


@pytest.mark.parametrize("dtype, arch, kernel", KERNELS)
def test_varlen_blocks_find_their_sequence(dtype, arch, kernel):
    """One launch over packed sequences of lengths 0 and 1 among longer ones (an empty
    query sequence, an empty key sequence), with 1 and 2 splits, checked mode: each
    sequence equals attention over its own rows alone, nothing is written outside."""
    lq, lk = [7, 0, 1, 70, 33], [12, 5, 0, 130, 33]
    q, k, v, cq, ck = _packed(lq, lk, 4, 2, 64, dtype)
    be = emulator_backend(arch, checked=True)
    seg = Segments(batch=len(lq), max_q=max(lq), max_k=max(lk), cu_q=cq, cu_k=ck)
    for splits in (1, 2):
        o, lse = be.forward(q, k, v, causal=True, scale=0.125, segments=seg, num_splits=splits)
        assert _launched(be).kernel == kernel
        assert o.shape == q.shape and lse.shape == q.shape[:3]
        for b in range(len(lq)):
            rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if rq.start == rq.stop:
                continue
            _check_against_reference(o[:, :, rq], lse[:, :, rq], q[:, :, rq], k[:, :, rk],
                                     v[:, :, rk], causal=True, scale=0.125,
                                     what=f"O of sequence {b} ({splits} splits)")


@pytest.mark.parametrize("dtype, arch, kernel", [KERNELS[0], KERNELS[3], KERNELS[5]])
def test_cache_lengths_limit_each_rows_keys(dtype, arch, kernel):
    """A padded (B, Hkv, Ncache, d) cache of which row b uses its first used_k[b] keys
    (0 included): garbage (NaN) past each row's length is never read into the result."""
    q, k, v = _inputs((4, 2, 3, 32), (4, 1, 200, 32), dtype, seed=3)
    used = np.array([200, 0, 1, 77], dtype=np.int32)
    for b, n in enumerate(used):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    be = emulator_backend(arch)
    seg = Segments(batch=4, max_q=3, max_k=int(used.max()), used_k=used)
    for splits in (1, 4):
        o, lse = be.forward(q, k, v, causal=True, scale=0.2, segments=seg, num_splits=splits)
        assert _launched(be).kernel == kernel
        for b, n in enumerate(used):
            _check_against_reference(o[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n],
                                     v[b:b + 1, :, :n], causal=True, scale=0.2,
                                     what=f"O of row {b} ({splits} splits)")


@pytest.mark.parametrize("dtype, arch, kernel", [KERNELS[1], KERNELS[2], KERNELS[4], KERNELS[5]])
def test_paged_cache_is_read_through_the_block_table(dtype, arch, kernel):
    """Keys in 128-key pages in a random order, a page shared by two rows, unused pages
    full of NaN, 1 and 3 splits, checked mode: row b equals attention over its pages'
    keys in table order."""
    rng = np.random.default_rng(4)
    B, page, max_pages, d = 3, 128, 3, 32
    q = rng.standard_normal((B, 4, 2, d)).astype(dtype)
    pages = rng.standard_normal((2, 8, 2, page, d)).astype(dtype)  # k, v: 8 pages, 2 heads
    table = np.array([[5, 2, 7], [5, 0, 3], [1, 6, 4]], dtype=np.int32)  # page 5 shared
    used = np.array([300, 129, 0], dtype=np.int32)
    for b, n in enumerate(used):  # the keys past each row's length: never read
        for p in range(-(-int(n) // page), max_pages):
            if table[b, p] not in table[:b].ravel() and table[b, p] not in table[b + 1:].ravel():
                pages[:, table[b, p]] = np.nan
    be = emulator_backend(arch, checked=True)
    seg = Segments(batch=B, max_q=2, max_k=int(used.max()), used_k=used, block_table=table)
    for splits in (1, 3):
        o, lse = be.forward(q, pages[0], pages[1], causal=True, scale=0.2, segments=seg,
                            num_splits=splits)
        assert _launched(be).kernel == kernel
        for b, n in enumerate(used):
            pos = np.arange(n)
            k, v = (pages[i][table[b, pos // page], :, pos % page].transpose(1, 0, 2)[None]
                    for i in (0, 1))
            _check_against_reference(o[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v, causal=True,
                                     scale=0.2, what=f"O of row {b} ({splits} splits)")


SIMT_BWD = ("flash_bwd_dkdv", "flash_bwd_dq")
TC_BWD = tuple(tiling.TC_BWD_KERNELS)
TC_BWD5 = ("flash_bwd_dkdv_tc", "flash_bwd_dq_sum")   # 5 GEMMs: dQ's partials, their sum


@pytest.mark.parametrize("dtype, arch, d, kernels", [
    pytest.param(F32, "sm_70", 40, SIMT_BWD, id="simt-f32-sm70"),
    pytest.param(F64, "sm_80", 40, SIMT_BWD, id="simt-f64-sm80"),
    pytest.param(F16, "sm_70", 40, SIMT_BWD, id="simt-f16-sm70"),
    pytest.param(F16, "sm_75", 40, TC_BWD5, id="tc-f16-sm75"),
    pytest.param(BF16, "sm_80", 200, TC_BWD, id="tc-bf16-sm80-d200")])
def test_varlen_backward_blocks_find_their_sequence(dtype, arch, d, kernels):
    """The backward over packed sequences (empty ones among them) in one launch of each
    kernel (preprocess, dK/dV, dQ; SIMT on sm_70, tensor cores from sm_75: d = 40 the
    5-GEMM backward, whose dQ partials take the packed rows, d = 200 in head-dim chunks
    and two kernels), checked mode: each sequence's gradients equal the float64
    reference's for that sequence alone, by the rule for gradients."""
    lq, lk = [5, 0, 1, 40, 9], [8, 6, 0, 70, 9]
    q, k, v, cq, ck = _packed(lq, lk, 4, 2, d, dtype)
    do = np.random.default_rng(9).standard_normal(q.shape).astype(dtype)
    be = emulator_backend(arch, checked=True)
    seg = Segments(batch=len(lq), max_q=max(lq), max_k=max(lk), cu_q=cq, cu_k=ck)
    o, lse = be.forward(q, k, v, causal=True, scale=0.15, segments=seg, num_splits=1)
    be.take_launches()
    # the 5-GEMM backward with one worker per (sequence, K/V head): it walks every key
    # block of its sequence, adding dQ for the packed rows of that sequence alone
    dq, dk, dv = kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=0.15,
                                          segments=seg,
                                          dq_workers=1 if kernels == TC_BWD5 else None)
    launched = tuple(p.kernel for p in be.take_launches())
    assert launched == ("flash_bwd_preprocess", *kernels), launched
    for b in range(len(lq)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop or rk.start == rk.stop:  # no (query, key) pair: zero
            np.testing.assert_array_equal(dq[:, :, rq], 0)
            np.testing.assert_array_equal(dk[:, :, rk], 0)
            np.testing.assert_array_equal(dv[:, :, rk], 0)
            continue
        args = (do[:, :, rq], q[:, :, rq], k[:, :, rk], v[:, :, rk], o[:, :, rq], lse[:, :, rq])
        want = reference.attention_backward(*args, causal=True, scale=0.15)
        plain = plain_backward(*args, causal=True, scale=0.15, dtype=dtype)
        for name, got, w, p in zip(("dq", "dk", "dv"), (dq[:, :, rq], dk[:, :, rk],
                                                        dv[:, :, rk]), want, plain):
            assert_close_to_reference(got, w, p, dtype, factor=3.0, what=f"{name} of {b}")
