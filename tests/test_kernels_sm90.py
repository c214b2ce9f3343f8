"""The Hopper forward (kernels/flash_fwd_sm90.cu) in the emulator's sm_90a: TMA, mbarriers, a
producer warpgroup, wgmma with P̃ from registers; against the float64 reference with
FlashAttention's tolerance rule, in checked mode (races, bounds, every asynchronous hazard),
and bitwise equal under reversed and random block schedules. Its inputs' checks. And the
same kernel on an H100 (`gpu`), for the day one is lent.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _dtypes, reference, tiling
from cuflash.backends import kernel_forward_sm90 as sm90
from cuflash.backends import kernels
from cuflash.variants import Variants

from conftest import (HAS_GXX, assert_close_to_reference, assert_lse_close,
                      attention_inputs, emulator_backend, hopper_gpu_backend, plain_attention,
                      plain_lse, plain_tf32_attention, round_tf32, to_host, variant_options,
                      variants_of)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
F16, BF16, F32 = np.dtype(np.float16), _dtypes.BFLOAT16, np.dtype(np.float32)
# float32 inputs as the kernel takes them: one-pass tf32 (allow_tf32=True), split tf32
TF32, SPLIT = "tf32", "split-tf32"


def _float32(dtype):
    """(the inputs' dtype, forward_sm90's allow_tf32) for a dtype or TF32 / SPLIT."""
    return (F32, dtype == TF32) if dtype in (TF32, SPLIT) else (dtype, False)


def _backend(checked=False, schedule="round-robin"):
    return kernels.emulator_backend(checked=checked, schedule=schedule, seed=2, arch="sm_90a")


def _check(backend, B, H, Hkv, Nq, Nk, D, causal, seed=0, dtype=F16, num_blocks=None, opts=None,
           num_splits=1):
    """The kernel against the float64 reference; `opts` as flash_attention takes the
    variants (4-D bias and mask)."""
    opts = opts or {}
    dt, allow_tf32 = _float32(dtype)
    q, k, v = attention_inputs(B, H, Hkv, Nq, Nk, D, dt, seed=seed)[:3]
    scale = D ** -0.5
    xp = backend.xp
    var = variants_of(opts, xp)
    o, lse = sm90.forward_sm90(backend, xp.asarray(q), xp.asarray(k), xp.asarray(v),
                               causal=causal, scale=scale, variants=var, num_blocks=num_blocks,
                               num_splits=num_splits, allow_tf32=allow_tf32)
    kr, vr = (np.repeat(x, H // Hkv, axis=1) for x in (k, v))
    _assert_attention(o, lse, q, kr, vr, causal, scale, dtype, opts,
                      what=f"O (D={D}, causal={causal})")
    return to_host(o), to_host(lse)


def _assert_attention(o, lse, q, k, v, causal, scale, dtype, opts, what):
    """o, lse of q, k, v (heads repeated) against the float64 reference, by FlashAttention's
    rule over a plain implementation in `dtype` (TF32: one-pass tf32); SPLIT by the float32
    rule."""
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                               return_lse=True, **opts)
    if dtype == SPLIT:
        assert_close_to_reference(o, ref_o, None, F32, what=what)
        assert_lse_close(lse, ref_lse, F32)
    elif dtype == TF32:
        plain = plain_tf32_attention(q, k, v, causal=causal, scale=scale, **opts)
        assert_close_to_reference(o, ref_o, plain, round_tf32, what=what)
        scores = {n: x for n, x in opts.items() if n not in ("dropout_p", "seed")}
        assert_lse_close(lse, ref_lse, F32, precision=round_tf32,
                         plain=plain_lse(round_tf32(q), round_tf32(k), causal=causal,
                                         scale=scale, dtype=F32, **scores))
    else:
        plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype, **opts)
        assert_close_to_reference(o, ref_o, plain, dtype, what=what)
        assert_lse_close(lse, ref_lse, dtype)
    assert to_host(o).dtype == _float32(dtype)[0]


@pytest.mark.parametrize("dt,D", [(dt, D) for dt in (F16, BF16) for D in sm90.HEAD_DIMS]
                         + [(TF32, D) for D in sm90.TF32_HEAD_DIMS]
                         + [(SPLIT, D) for D in tiling.SM90_SPLIT_HEAD_DIMS],
                         ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,causal", [
    (1, 2, 1, 128, 256, False),    # whole tiles, MQA: the ring wraps
    (2, 4, 2, 200, 300, True),     # GQA, partial query and key tiles, the diagonal inside a tile
    (1, 2, 2, 130, 100, True),     # Nq > Nk: the first 30 rows see no key (O = 0, lse = −inf)
    (1, 1, 1, 5, 1, False),        # one key, a few rows
])
def test_forward(dt, D, B, H, Hkv, Nq, Nk, causal):
    """16-bit; float32 as one-pass tf32 (Q_i and K_j rounded in shared memory, V_jᵀ written by
    the producer's warps, P̃ rounded in registers: FlashAttention's rule over a plain tf32
    attention) and as split tf32 (the lo parts beside them; at D = 128 one consumer
    warpgroup and 32-key tiles: the float32 rule)."""
    o, lse = _check(_backend(), B, H, Hkv, Nq, Nk, D, causal, seed=Nq + Nk + D, dtype=dt)
    if causal and Nq > Nk:
        assert np.all(o[..., :Nq - Nk, :] == 0) and np.all(np.isneginf(lse[..., :Nq - Nk]))


@pytest.mark.parametrize("allow_tf32,D", [(True, 64), (False, 64), (False, 128)],
                         ids=["tf32", "split-tf32", "split-tf32-128"])
def test_tf32_nan_reaches_its_row(allow_tf32, D):
    """A NaN in one query row: that row's O and lse are NaN (through ℓ: P̃'s tf32 rounding
    may turn a NaN into a tiny number), every other row as without it."""
    q, k, v = attention_inputs(1, 2, 1, 150, 200, D, F32, seed=4)[:3]

    def run():
        return (to_host(x) for x in sm90.forward_sm90(_backend(), q, k, v, causal=True,
                                                      scale=0.125, allow_tf32=allow_tf32))
    o, lse = run()
    q[0, 1, 140, 5] = np.nan
    o_nan, lse_nan = run()
    assert np.all(np.isnan(o_nan[0, 1, 140])) and np.isnan(lse_nan[0, 1, 140])
    o_nan[0, 1, 140], lse_nan[0, 1, 140] = o[0, 1, 140], lse[0, 1, 140]
    np.testing.assert_array_equal(o_nan, o)
    np.testing.assert_array_equal(lse_nan, lse)


@pytest.mark.parametrize("D,schedule,dt", [(64, "reversed", F16), (128, "random", BF16),
                                           (256, "random", F16), (64, "random", TF32),
                                           (128, "reversed", TF32), (256, "random", TF32),
                                           (64, "random", SPLIT), (128, "random", SPLIT)])
def test_checked_and_schedules(D, schedule, dt):
    """No hazard of any kind the emulator checks (a wgmma's A registers, the ring's slots,
    the copies' bytes), and the same bits as round-robin."""
    args = (1, 2, 1, 160, 300, D, True)
    o, lse = _check(_backend(checked=True, schedule=schedule), *args, seed=D, dtype=dt)
    o_rr, lse_rr = _check(_backend(), *args, seed=D, dtype=dt)
    np.testing.assert_array_equal(o, o_rr)
    np.testing.assert_array_equal(lse, lse_rr)


@pytest.mark.parametrize("window,causal,Nq,Nk", [
    ((100, 0), False, 300, 420),    # 100 keys back to the diagonal: tiles left of it skipped
    ((0, 100), False, 300, 300),    # the diagonal to 100 ahead: tiles beyond it skipped
    ((130, -1), True, 400, 300),    # causal with a left edge; Nq > Nk: rows with no key
    ((5, 7), False, 260, 1000),     # a narrow band across tile boundaries
])
def test_window(window, causal, Nq, Nk):
    """The sliding window (mask.cuh's, bottom-right aligned) against the float64 reference;
    checked mode with two blocks walking the tiles: the ring skips what no row sees."""
    o, lse = _check(_backend(checked=True, schedule="random"), 2, 2, 1, Nq, Nk, 64, causal,
                    seed=Nq + Nk, num_blocks=2, opts=dict(window=window))
    if causal and Nq > Nk:
        assert np.all(o[..., :Nq - Nk, :] == 0) and np.all(np.isneginf(lse[..., :Nq - Nk]))


@pytest.mark.parametrize("names,causal,dt", [
    (["softcap"], False, F16), (["alibi"], True, BF16), (["bias"], False, F16),
    (["bias_f32"], True, F16), (["mask"], False, BF16), (["dropout"], True, F16),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, BF16),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, TF32),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, SPLIT),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, (SPLIT, 128)),
    (["window", "softcap", "alibi", "bias", "mask", "dropout"], True, (TF32, 256)),
], ids=lambda x: "+".join(x) if isinstance(x, list) else str(x))
def test_variants(names, causal, dt):
    """Every attention variant, alone and all at once, against the float64 reference
    (dropout's keep decisions are cuflash.dropout_mask's: the reference draws the same);
    GQA, partial tiles, two blocks walking the tiles; D = 64 (float32's 64 x 32 tiles too:
    split at 128, one-pass at 256)."""
    dt, D = dt if isinstance(dt, tuple) else (dt, 64)
    B, H, Hkv, Nq, Nk = 2, 2, 1, 150, 200
    _check(_backend(), B, H, Hkv, Nq, Nk, D, causal, seed=7, dtype=dt, num_blocks=2,
           opts=variant_options(names, _float32(dt)[0], (B, H, Hkv, Nq, Nk, D)))


@pytest.mark.parametrize("D", [128, 256])
def test_variants_checked_at_ragged_sizes(D):
    """Every option, Nq and Nk not multiples of the tile, in checked mode: no race, and no
    bias or mask read outside [0, Nq) x [0, Nk); D = 256's 64-key tiles too."""
    B, H, Nq, Nk = 1, 2, 37, 75
    _check(_backend(checked=True, schedule="random"), B, H, 1, Nq, Nk, D, True, seed=6,
           opts=variant_options(["window", "softcap", "alibi", "bias", "mask", "dropout"], F16,
                                (B, H, 1, Nq, Nk, D)))


@pytest.mark.parametrize("D,dt,Nq,Nk,causal,schedule", [
    (64, F16, 300, 260, True, "random"),      # 3 query blocks x 4 heads: 12 tiles, heaviest first
    (128, BF16, 300, 100, True, "reversed"),  # Nq > Nk: tiles with no key amid the walk
    (64, BF16, 260, 390, False, "random"),
    (256, F16, 300, 200, True, "random"),     # 64-key tiles, O from registers
    (128, SPLIT, 200, 150, True, "random"),   # one consumer warpgroup: 64-row tiles
])
def test_persistent_blocks_walk_many_tiles(D, dt, Nq, Nk, causal, schedule):
    """Two blocks walk every (query block, head, batch) tile: the K/V ring, Q_i and the O
    buffer carry on from tile to tile. Checked mode finds no hazard or deadlock, and the
    bits are those of one block per tile."""
    args = (2, 2, 1, Nq, Nk, D, causal)
    o, lse = _check(_backend(checked=True, schedule=schedule), *args, seed=D + Nq, dtype=dt,
                    num_blocks=2)
    o_1, lse_1 = _check(_backend(), *args, seed=D + Nq, dtype=dt)
    np.testing.assert_array_equal(o.view(np.uint16), o_1.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_1)


def test_the_consumers_take_turns(monkeypatch):
    """Without warpgroup 1's first arrival on warpgroup 0's named barrier neither consumer
    can issue: the emulator reports the deadlock (the ping-pong is really there)."""
    from cuflash import compiler
    from cuflash.emulator import DeadlockError
    source = compiler.read_source("flash_fwd_sm90.cu")
    line = "    if (warpgroup == 1) your_turn();"
    assert line in source
    monkeypatch.setattr(compiler, "read_source", lambda name: source.replace(line, ""))
    be = kernels.emulator_backend(seed=90, arch="sm_90a")   # its own compiled functions
    q, k, v = attention_inputs(1, 1, 1, 64, 64, 64, F16)[:3]
    with pytest.raises(DeadlockError, match="deadlock"):
        sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)


def test_the_planner_takes_it_for_plain_calls(monkeypatch):
    """On an sm_90a device a plain 16-bit call with d = 64, 128 or 256 (float32 with
    allow_tf32 and d = 64, 128 or 256, split at 64 or 128) runs the Hopper forward:
    flash_attention gives the bits of launching it directly, not those of the mma.sync
    kernel (which sm_90 without the "a" features runs)."""
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_90a")
    q, k, v = attention_inputs(1, 2, 1, 100, 120, 64, F16, seed=11)[:3]
    o, lse = cuflash.flash_attention(q, k, v, causal=True, return_lse=True, backend="emulator")
    o_sm90, lse_sm90 = sm90.forward_sm90(_backend(), q, k, v, causal=True, scale=0.125)
    np.testing.assert_array_equal(o.view(np.uint16), o_sm90.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_sm90)
    o_w = cuflash.flash_attention(q, k, v, window=(40, 0), softcap=2.0,   # the variants too
                                  backend="emulator")
    o_w_sm90, _ = sm90.forward_sm90(_backend(), q, k, v, causal=False, scale=0.125,
                                    variants=Variants(window=(40, 0), softcap=2.0))
    np.testing.assert_array_equal(o_w.view(np.uint16), o_w_sm90.view(np.uint16))
    # one-pass tf32 too (64 keys: one key tile of its, which the API does not split)
    q32, k32, v32 = (x[:, :, :64].astype(np.float32) for x in (q, k, v))
    o32 = cuflash.flash_attention(q32, k32, v32, causal=True, backend="emulator", allow_tf32=True)
    o32_sm90, _ = sm90.forward_sm90(_backend(), q32, k32, v32, causal=True, scale=0.125,
                                    allow_tf32=True)
    np.testing.assert_array_equal(o32, o32_sm90)
    o32_split = cuflash.flash_attention(q32, k32, v32, causal=True, backend="emulator")
    o32_split_sm90, _ = sm90.forward_sm90(_backend(), q32, k32, v32, causal=True, scale=0.125)
    np.testing.assert_array_equal(o32_split, o32_split_sm90)
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_90")
    o_mma = cuflash.flash_attention(q, k, v, causal=True, backend="emulator")
    assert not np.array_equal(o_mma.view(np.uint16), o.view(np.uint16))
    o32_mma = cuflash.flash_attention(q32, k32, v32, causal=True, backend="emulator",
                                      allow_tf32=True)
    assert not np.array_equal(o32_mma, o32)
    o32_split_mma = cuflash.flash_attention(q32, k32, v32, causal=True, backend="emulator")
    assert not np.array_equal(o32_split_mma, o32_split)


def test_what_the_planner_gives_the_mma_sync_kernel():
    """Calls the Hopper kernel does not take yet run mma.sync on sm_90a, and the reason
    says so: a negative scale, float32, d = 96, rows 136 bytes apart, and sm_90 without
    the "a" features; split-KV it takes."""
    from cuflash.backends import kernel_forward
    be = _backend()
    q, k, v = attention_inputs(1, 2, 1, 100, 120, 64, F16)[:3]

    def plan(q=q, k=k, v=v, backend=be, **call):
        return kernel_forward.forward_plan(backend, q, k, v, **{"scale": 0.125, **call})
    assert isinstance(plan(), tiling.Sm90FwdPlan)
    for call in (dict(scale=-0.125), dict(scale=None)):
        assert type(plan(**call)) is tiling.TcPlan, call
    assert isinstance(plan(num_splits=2), tiling.Sm90FwdPlan)
    long_keys = attention_inputs(1, 1, 1, 64, 1024, 64, F16)[:3]   # 1 query block, 8 key tiles
    assert isinstance(plan(*long_keys), tiling.Sm90FwdPlan)          # split-KV
    assert isinstance(plan(*attention_inputs(4, 32, 8, 256, 1024, 64, F16)[:3]), tiling.Sm90FwdPlan)
    assert type(plan(*attention_inputs(1, 2, 1, 100, 120, 96, F16)[:3])) is tiling.TcPlan
    d256 = plan(*attention_inputs(4, 32, 8, 256, 1024, 256, F16)[:3])   # 64-key tiles
    assert isinstance(d256, tiling.Sm90FwdPlan) and d256.block_n == 64
    assert d256.smem_bytes == (4 * 16 + 2 * 2 * 4 * 8) * 1024   # Q; K, V rings; no O staging
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    split = plan(*f32)                                               # split tf32: wgmma at 64
    assert isinstance(split, tiling.Sm90FwdPlan) and split.split and split.block_n == 64
    assert split.smem_bytes == 2 * (2 * 16 + 2 * 2 * 8 + 2 * 16) * 1024 + 2 * 2 * 8 * 1024
    tf32 = plan(*f32, allow_tf32=True)                               # one-pass: wgmma
    assert isinstance(tf32, tiling.Sm90FwdPlan) and not tf32.split and tf32.block_n == 64
    assert tf32.smem_bytes == (2 * 16 + (2 + 2) * 2 * 8 + 2 * 16) * 1024   # Q; K, V; V_jᵀ
    f32_128 = [x.astype(np.float32) for x in attention_inputs(1, 2, 1, 100, 120, 128, F16)[:3]]
    assert plan(*f32_128, allow_tf32=True).smem_bytes == (4 * 16 + (2 + 1) * 4 * 8 + 2 * 32) * 1024
    narrow = plan(*f32_128)                                          # split at 128: 64 x 32
    assert isinstance(narrow, tiling.Sm90FwdPlan) and narrow.split and narrow.block_m == 64
    assert (narrow.block_n, narrow.num_threads) == (32, 256)
    # Q_i and K_j, V_j's two slots, V_jᵀ's two, and the lo parts of Q_i, K_j, V_jᵀ
    assert narrow.smem_bytes == (32 + 2 * 16 + 2 * 16 + 2 * 16 + 32 + 2 * 16 + 2 * 16) * 1024
    f32_256 = [x.astype(np.float32) for x in attention_inputs(1, 2, 1, 100, 120, 256, F16)[:3]]
    wide = plan(*f32_256, allow_tf32=True)                           # one-pass at 256: 64 x 32
    assert isinstance(wide, tiling.Sm90FwdPlan) and (wide.block_m, wide.block_n) == (64, 32)
    assert wide.smem_bytes == (64 + 2 * 32 + 32 + 2 * 32) * 1024     # Q; K; one V slot; V_jᵀ
    assert type(plan(*f32_256)) is tiling.Tf32Plan                   # split at 256: mma.sync
    f32_96 = [x.astype(np.float32) for x in attention_inputs(1, 2, 1, 100, 120, 96, F16)[:3]]
    assert type(plan(*f32_96, allow_tf32=True)) is tiling.Tf32Plan
    bnhd = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert isinstance(plan(q=bnhd), tiling.Sm90FwdPlan)              # TMA reads it in place
    padded = np.zeros(q.shape[:-1] + (72,), F16)[..., :64]           # rows 144 bytes apart
    assert isinstance(plan(q=padded), tiling.Sm90FwdPlan)
    padded = np.zeros(q.shape[:-1] + (68,), F16)[..., :64]           # 136: not a multiple of 16
    assert not isinstance(plan(q=padded), tiling.Sm90FwdPlan)
    assert type(plan(backend=kernels.emulator_backend(arch="sm_90"))) is tiling.TcPlan
    _, why = tiling.forward_path(96, "float16", (9, 0), max_smem=232448, sm90a=True, plain=True)
    assert "mma.m16n8k16" in why and "d = 64, 128 or 256" in why
    _, why = tiling.forward_path(128, "bfloat16", (9, 0), max_smem=232448, sm90a=True, plain=True)
    assert "wgmma on sm_90a" in why
    _, why = tiling.forward_path(128, "float32", (9, 0), max_smem=232448, sm90a=True, plain=True)
    assert "wgmma on sm_90a" in why
    _, why = tiling.forward_path(96, "float32", (9, 0), max_smem=232448, sm90a=True, plain=True)
    assert "d = 64 or 128 as split tf32, 64, 128 or 256 with allow_tf32=True (one-pass" in why


def _packed_check(backend, lens_q, lens_k, H, Hkv, D, causal, dtype=F16, opts=None,
                  num_blocks=None, num_splits=1):
    """The kernel over packed sequences: each sequence's O and lse against its own float64
    reference."""
    from cuflash.backends.kernel_forward import Segments
    opts = opts or {}
    scale = D ** -0.5
    dt, allow_tf32 = _float32(dtype)
    seqs = [attention_inputs(1, H, Hkv, nq, nk, D, dt, seed=b)[:3]
            for b, (nq, nk) in enumerate(zip(lens_q, lens_k))]
    q, k, v = (np.concatenate(xs, axis=2) for xs in zip(*seqs))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    xp = backend.xp
    segments = Segments(batch=len(lens_q), max_q=max(lens_q), max_k=max(lens_k),
                        cu_q=xp.asarray(cu_q), cu_k=xp.asarray(cu_k))
    o, lse = sm90.forward_sm90(backend, *map(xp.asarray, (q, k, v)), causal=causal,
                               scale=scale, segments=segments, num_blocks=num_blocks,
                               num_splits=num_splits, allow_tf32=allow_tf32,
                               variants=variants_of(opts, xp) if opts else None)
    o, lse = to_host(o), to_host(lse)
    for b, (qb, kb, vb) in enumerate(seqs):
        kr, vr = (np.repeat(x, H // Hkv, axis=1) for x in (kb, vb))
        rows = slice(cu_q[b], cu_q[b + 1])
        _assert_attention(o[:, :, rows], lse[:, :, rows], qb, kr, vr, causal, scale, dtype,
                          opts, what=f"O of sequence {b}")


@pytest.mark.parametrize("causal,opts", [(False, None), (True, None),
                                         (True, dict(window=(60, -1), softcap=0.7))])
def test_packed_sequences(causal, opts):
    """Packed sequences (varlen): each tile reads its sequence's rows at its offsets (the
    boxes' rows past its end, the next sequence's, masked as keys and left unwritten as
    queries), tiles past a sequence's end are skipped; lengths that cross tiles, one of a
    single row, more keys than queries and fewer; one block per tile, and three blocks
    walking them."""
    for num_blocks in (None, 3):
        _packed_check(_backend(), [70, 200, 1, 130], [90, 150, 64, 130], 4, 2, 64, causal,
                      opts=opts, num_blocks=num_blocks)


def test_the_planner_gives_packed_sequences_to_it():
    """kernel_forward.forward with packed sequences on sm_90a: the Hopper kernel."""
    from cuflash.backends import kernel_forward
    from cuflash.backends.kernel_forward import Segments
    be = emulator_backend("sm_90a")
    q, k, v = (np.zeros((1, 32, 4096, 64), F16) for _ in range(3))
    cu = np.array([0, 1000, 4096], np.int32)
    packed = Segments(batch=2, max_q=3096, max_k=3096, cu_q=cu, cu_k=cu)
    assert isinstance(kernel_forward.forward_plan(be, q, k, v, scale=0.125, segments=packed),
                      tiling.Sm90FwdPlan)



@pytest.mark.parametrize("D,dt,causal,opts", [
    (64, F16, False, None), (128, BF16, True, None), (256, F16, True, dict(window=(100, 20))),
    (64, BF16, True, dict(softcap=1.5))])
def test_split_kv(D, dt, causal, opts):
    """Split-KV: each split's tiles over its share of the key tiles (seqlens.cuh's rule), its
    O and lse merged after (merge_states); 2 and 3 splits against the reference, splits
    that some rows see no key of (causal, the window: lse −inf there), MQA, and a split
    count above the key tiles (empty splits)."""
    for splits in (2, 3, 9):
        _check(_backend(), 1, 2, 1, 150, 520, D, causal, seed=D + splits, dtype=dt, opts=opts,
               num_splits=splits)
    q, k, v = attention_inputs(1, 1, 1, 16, 16, D, dt)[:3]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"num_splits must be a positive int; got {bad!r}"):
            sm90.forward_sm90(_backend(), q, k, v, causal=causal, scale=0.1, num_splits=bad)


def test_split_kv_checked_packed_and_cached():
    """Split-KV in checked mode under a random schedule (no hazard, no row written twice),
    over packed sequences and a paged KV cache."""
    be = _backend(checked=True, schedule="random")
    _check(be, 1, 2, 2, 130, 300, 128, True, dtype=BF16, num_splits=3)
    _packed_check(be, [30, 150], [290, 70], 2, 1, 64, True, num_splits=2)
    _cache_check(_backend(), [300, 130], 150, 2, 1, 64, True, page=128, num_splits=3)


def test_tf32_packed_cached_and_split_checked():
    """One-pass and split tf32 over packed sequences, a paged KV cache (64-key pages: its
    key tile) and split-KV, in checked mode under a random schedule: its store of O from
    registers stops at each sequence's end."""
    be = _backend(checked=True, schedule="random")
    _packed_check(be, [30, 150], [290, 70], 2, 1, 64, True, dtype=TF32, num_splits=2)
    _packed_check(be, [70, 20], [50, 130], 2, 2, 128, False, dtype=TF32)
    _packed_check(be, [70, 20], [50, 130], 2, 2, 64, True, dtype=SPLIT)
    _cache_check(be, [300, 130], 150, 2, 1, 64, True, page=64, dtype=TF32, num_splits=3)
    _cache_check(be, [300, 130], 150, 2, 1, 64, False, page=64, dtype=SPLIT)
    _check(be, 1, 2, 1, 130, 300, 128, True, dtype=TF32, num_splits=3)
    _check(be, 1, 2, 1, 130, 300, 64, True, dtype=SPLIT, num_splits=2)
    # split at D = 128 and one-pass at 256: 32-key tiles (and pages), one consumer warpgroup
    _packed_check(be, [70, 20], [50, 130], 2, 1, 128, True, dtype=SPLIT, num_splits=2)
    _cache_check(be, [300, 130], 150, 2, 1, 128, True, page=32, dtype=SPLIT)
    _packed_check(be, [70, 20], [50, 130], 2, 2, 256, False, dtype=TF32)
    _cache_check(be, [300, 130], 150, 2, 1, 256, True, page=32, dtype=TF32, num_splits=2)


def test_the_planner_splits_the_keys_on_it(monkeypatch):
    """A call whose query blocks leave SMs idle runs the Hopper kernel with split-KV
    (`tiling.split_kv_count` over its 128-row tiles): flash_attention gives the bits of
    launching it directly with that many splits, and it did split."""
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_90a")
    q, k, v = attention_inputs(1, 2, 1, 100, 1000, 64, F16, seed=21)[:3]
    splits = tiling.split_kv_count(2, 8, _backend().limits()["sm_count"])
    assert splits > 1
    seen = []
    launch = sm90.forward_sm90
    monkeypatch.setattr(sm90, "forward_sm90",
                        lambda *a, **kw: seen.append(kw["num_splits"]) or launch(*a, **kw))
    o, lse = cuflash.flash_attention(q, k, v, causal=True, return_lse=True, backend="emulator")
    assert seen == [splits]
    o_direct, lse_direct = launch(_backend(), q, k, v, causal=True, scale=0.125,
                                  num_splits=splits)
    np.testing.assert_array_equal(o.view(np.uint16), o_direct.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_direct)


@pytest.mark.parametrize("D", [128, 256])
def test_packed_sequences_checked(D):
    """The same in checked mode under a random schedule: no hazard, no row of the next
    sequence written."""
    _packed_check(_backend(checked=True, schedule="random"), [30, 150], [50, 70], 2, 1, D,
                  True, dtype=BF16)


def _cache_check(backend, used, Nq, H, Hkv, D, causal, page=None, dtype=F16, opts=None,
                 num_splits=1):
    """The kernel with a KV cache: q (B, H, Nq, D), batch row b's keys the first used[b]
    of its cache (contiguous), or of its pages in a shuffled block table (`page` rows
    each); each row's O and lse against its own float64 reference."""
    from cuflash.backends.kernel_forward import Segments
    opts = opts or {}
    B, Ncache, scale = len(used), -(-max(used) // 128) * 128, D ** -0.5
    rng = np.random.default_rng(sum(used))
    dt, allow_tf32 = _float32(dtype)
    q = rng.standard_normal((B, H, Nq, D)).astype(dt)
    k, v = (rng.standard_normal((B, Hkv, Ncache, D)).astype(dt) for _ in range(2))
    xp = backend.xp
    table = None
    kc, vc = k, v
    if page is not None:   # the cache's pages, one batch row after the other, shuffled
        per_row = Ncache // page
        order = rng.permutation(B * per_row + 3)[:B * per_row]
        kc, vc = (np.zeros((B * per_row + 3, Hkv, page, D), dt) for _ in range(2))
        for b in range(B):
            for j in range(per_row):
                kc[order[b * per_row + j]] = k[b, :, j * page:(j + 1) * page]
                vc[order[b * per_row + j]] = v[b, :, j * page:(j + 1) * page]
        table = xp.asarray(order.reshape(B, per_row).astype(np.int32))
    segments = Segments(batch=B, max_q=Nq, max_k=max(used),
                        used_k=xp.asarray(np.array(used, np.int32)), block_table=table)
    o, lse = sm90.forward_sm90(backend, *map(xp.asarray, (q, kc, vc)), causal=causal,
                               scale=scale, segments=segments, num_splits=num_splits,
                               allow_tf32=allow_tf32,
                               variants=variants_of(opts, xp) if opts else None)
    o, lse = to_host(o), to_host(lse)
    for b, n in enumerate(used):
        kb, vb = (np.repeat(x[b:b + 1, :, :n], H // Hkv, axis=1) for x in (k, v))
        _assert_attention(o[b:b + 1], lse[b:b + 1], q[b:b + 1], kb, vb, causal, scale, dtype,
                          opts, what=f"O of row {b}")


@pytest.mark.parametrize("page", [None, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_kv_cache(page, causal):
    """A KV cache, contiguous or paged: each batch row's keys up to its own length (the
    box's rows past it masked), causal bottom-right against that length, key tiles from
    their pages (a shuffled block table)."""
    _cache_check(_backend(), [300, 130, 512], 150, 4, 2, 64, causal, page=page,
                 opts=dict(softcap=2.0) if causal else None)


def test_kv_cache_checked():
    """The paged cache at D = 256 (64-key tiles from 128-row pages) in checked mode."""
    _cache_check(_backend(checked=True, schedule="random"), [200, 70], 90, 2, 1, 256, True,
                 page=128, dtype=BF16)


def test_the_planner_gives_kv_caches_to_it():
    """kernel_forward.forward_plan with a cache on sm_90a: the Hopper kernel for a prefill
    whose query blocks fill the SMs, where the pages are whole key tiles; mma.sync for a
    decode step (split-KV) and 64-row pages."""
    from cuflash.backends import kernel_forward
    from cuflash.backends.kernel_forward import Segments
    be = emulator_backend("sm_90a")
    q = np.zeros((4, 32, 1024, 128), F16)
    used = np.array([4000, 3000, 4096, 100], np.int32)
    for page, hopper in ((None, True), (128, True), (64, False)):
        k = np.zeros((4, 8, 4096, 128) if page is None else (256, 8, page, 128), F16)
        table = (None if page is None else
                 np.arange(4 * 4096 // page, dtype=np.int32).reshape(4, -1) % 256)
        seg = Segments(batch=4, max_q=1024, max_k=4096, used_k=used, block_table=table)
        plan = kernel_forward.forward_plan(be, q, k, k, scale=0.1, segments=seg)
        assert isinstance(plan, tiling.Sm90FwdPlan) is hopper, page
    decode = Segments(batch=4, max_q=1, max_k=4096, used_k=used)
    k = np.zeros((4, 8, 4096, 128), F16)
    assert type(kernel_forward.forward_plan(be, q[:, :, :1], k, k, scale=0.1,
                                            segments=decode)) is tiling.TcPlan


def test_strided_inputs():
    """q and v in (B, N, H, D) memory, k cut from rows twice as wide: the 4-D tensor maps
    read them in place, with the bits of contiguous copies."""
    q, k, v = attention_inputs(2, 4, 2, 100, 150, 64, F16, seed=5)[:3]
    q_s, v_s = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, v))
    wide = np.zeros(k.shape[:-1] + (128,), F16)
    wide[..., :64] = k
    k_s = wide[..., :64]
    assert sm90.tma_ready(q_s, k_s, v_s) and not any(x.flags.c_contiguous for x in (q_s, k_s, v_s))
    o, lse = sm90.forward_sm90(_backend(), q_s, k_s, v_s, causal=True, scale=0.125)
    o_c, lse_c = sm90.forward_sm90(_backend(), q, k, v, causal=True, scale=0.125)
    np.testing.assert_array_equal(o.view(np.uint16), o_c.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_c)


def test_no_key_and_no_query():
    be = _backend()
    q, k, v = attention_inputs(1, 2, 1, 7, 0, 64, F16)[:3]
    o, lse = sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)
    assert np.all(to_host(o) == 0) and np.all(np.isneginf(to_host(lse)))
    q, k, v = attention_inputs(1, 2, 1, 0, 9, 64, F16)[:3]
    o, lse = sm90.forward_sm90(be, q, k, v, causal=False, scale=0.125)
    assert o.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


def test_inputs_it_does_not_take_yet():
    be = _backend()
    q, k, v = attention_inputs(1, 2, 1, 8, 8, 64, F16)[:3]
    with pytest.raises(TypeError, match=r"the Hopper forward takes float16, bfloat16 or float32 "
                                        r"\(as tf32\), q, k, v alike; got float64"):
        sm90.forward_sm90(be, *(x.astype(np.float64) for x in (q, k, v)), causal=False, scale=1.0)
    with pytest.raises(ValueError, match=r"head dims \(64, 128, 256\) for float32"):
        sm90.forward_sm90(be, *attention_inputs(1, 2, 1, 8, 8, 96, F32)[:3], causal=False,
                          scale=1.0, allow_tf32=True)
    with pytest.raises(ValueError, match=r"float32 as split tf32 at head dims \(64, 128\) \(its "
                                         r"lo parts leave no room above\), as one-pass tf32 "
                                         r"\(allow_tf32=True\) at \(64, 128, 256\); got 256"):
        sm90.forward_sm90(be, *attention_inputs(1, 2, 1, 8, 8, 256, F32)[:3], causal=False,
                          scale=1.0)
    with pytest.raises(TypeError, match="alike"):
        sm90.forward_sm90(be, q, k.astype(BF16), v, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="head dims"):
        sm90.forward_sm90(be, *attention_inputs(1, 2, 1, 8, 8, 96, F16)[:3], causal=False, scale=1.0)
    with pytest.raises(ValueError, match="head dims"):
        sm90.forward_sm90(be, *attention_inputs(1, 2, 1, 8, 8, 512, F16)[:3], causal=False,
                          scale=1.0)
    padded = np.zeros(q.shape[:-1] + (68,), F16)   # rows 136 bytes apart
    with pytest.raises(ValueError, match=r"multiples of 16 bytes; got strides \(2176, 1088, 136, 2\)"):
        sm90.forward_sm90(be, padded[..., :64], k, v, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        sm90.forward_sm90(be, np.zeros(q.shape[:-1] + (128,), F16)[..., ::2], k, v, causal=False,
                          scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        sm90.forward_sm90(be, *attention_inputs(1, 3, 2, 8, 8, 64, F16)[:3], causal=False, scale=1.0)
    with pytest.raises(ValueError, match="positive finite scale"):
        sm90.forward_sm90(be, q, k, v, causal=False, scale=-0.5)
    with pytest.raises(ValueError, match="sm_90a"):
        sm90.forward_sm90(kernels.emulator_backend(arch="sm_80"), q, k, v, causal=False, scale=1.0)
    with pytest.raises(ValueError, match="this one is sm_90$"):
        sm90.forward_sm90(kernels.emulator_backend(arch="sm_90"), q, k, v, causal=False, scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", sm90.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu(dt, D, causal):
    """The same launch on an H100: the driver's tensor maps, NVRTC for sm_90a."""
    be = hopper_gpu_backend()
    _check(be, 2, 8, 2, 1000, 1500, D, causal, seed=D, dtype=dt)


@pytest.mark.gpu
@pytest.mark.parametrize("dt,D", [(TF32, 64), (TF32, 128), (TF32, 256), (SPLIT, 64), (SPLIT, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_tf32_on_the_gpu(dt, D, causal):
    """float32 on the H100's tf32 wgmma: V_jᵀ by the producer's warps, the rounding (the
    hardware's truncation of what is not rounded), split's lo parts."""
    _check(hopper_gpu_backend(), 2, 8, 2, 1000, 1500, D, causal, seed=D, dtype=dt)


@pytest.mark.gpu
@pytest.mark.parametrize("window,causal", [((256, 0), False), ((300, -1), True), ((7, 130), False)])
def test_window_on_the_gpu(window, causal):
    be = hopper_gpu_backend()
    _check(be, 2, 4, 2, 1000, 1300, 128, causal, seed=9, opts=dict(window=window))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_on_the_gpu(causal):
    """Packed sequences on an H100: the VARLEN specialization, O from registers."""
    be = hopper_gpu_backend()
    _packed_check(be, [700, 300, 1, 1000], [900, 200, 64, 1000], 8, 2, 128, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 256])
def test_kv_cache_on_the_gpu(page):
    """A KV cache, contiguous or paged, on an H100."""
    be = hopper_gpu_backend()
    _cache_check(be, [3000, 700, 4096], 500, 8, 2, 128, True, page=page)


@pytest.mark.gpu
def test_variants_on_the_gpu():
    """Every variant at once on an H100: the bias and mask read in place, dropout's bits."""
    be = hopper_gpu_backend()
    B, H, Nq, Nk = 2, 4, 700, 900
    _check(be, B, H, 2, Nq, Nk, 128, True, seed=4, opts=variant_options(
        ["window", "softcap", "alibi", "bias", "mask", "dropout"], F16, (B, H, 2, Nq, Nk, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_strided_and_persistent_on_the_gpu(causal):
    """On an H100: the driver's 4-D maps over (B, N, H, D) memory and padded rows, and three
    blocks walking every tile, with the bits of contiguous inputs and one block per tile."""
    be = hopper_gpu_backend()
    import cupy
    q, k, v = (cupy.asarray(x) for x in attention_inputs(2, 8, 2, 700, 900, 128, F16, seed=3)[:3])
    q_s, v_s = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, v))
    wide = cupy.zeros(k.shape[:-1] + (192,), F16)
    wide[..., :128] = k
    k_s = wide[..., :128]
    o, lse = sm90.forward_sm90(be, q_s, k_s, v_s, causal=causal, scale=0.1, num_blocks=3)
    o_c, lse_c = sm90.forward_sm90(be, q, k, v, causal=causal, scale=0.1)
    assert cupy.array_equal(o.view(cupy.uint16), o_c.view(cupy.uint16))
    assert cupy.array_equal(lse, lse_c)
    _check(be, 2, 8, 2, 700, 900, 128, causal, seed=3, num_blocks=3)
