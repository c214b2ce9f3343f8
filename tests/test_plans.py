"""The tile plans (cuflash.plans, re-exported by cuflash.tiling): the traits' shared-memory
formulas worked by hand, plans enumerable without ml_dtypes, Blackwell's compute
capabilities, and the split-KV rules' edge cases."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cuflash import tiling
from cuflash.serving import kvcache

KIB = 1024


def _find(plans, **fields):
    (plan,) = [p for p in plans if all(getattr(p, k) == v for k, v in fields.items())]
    return plan


# -- the shared-memory formulas, one per traits struct, worked by hand ------------------------
# (plan, bytes): each sum is the traits struct's terms (kernels/*_tile.cuh) in its own order.
SMEM_CASES = {
    # AttnTileTraits: sQ, sK, sV [rows][D + 1] and sP [Br][Bc + 1], accumulator type
    "AttnTileTraits-float32": (
        lambda: _find(tiling.all_simt_fwd_plans(), kernel="flash_fwd", dtype="float32",
                      head_dim_bucket=64, block_m=64, block_n=64),
        (64 * 65 + 64 * 65 + 64 * 65 + 64 * 65) * 4),
    "AttnTileTraits-float64": (
        lambda: _find(tiling.all_simt_fwd_plans(), kernel="flash_fwd", dtype="float64",
                      head_dim_bucket=32, block_m=64, block_n=32),
        (64 * 33 + 32 * 33 + 32 * 33 + 64 * 33) * 8),
    # TcTileTraits: sQ [Br][D], sK, sV [stages][Bc][D] in the 2-byte storage type
    "TcTileTraits": (
        lambda: _find(tiling.all_tc_plans(), dtype="bfloat16", head_dim=128, num_warps=4),
        (128 * 128 + 2 * 32 * 128 + 2 * 32 * 128) * 2),
    # Tf32TileTraits: the same tiles in float32
    "Tf32TileTraits": (
        lambda: _find(tiling.all_tf32_plans(), split=False, head_dim=128, block_m=64),
        (64 * 128 + 2 * 32 * 128 + 2 * 32 * 128) * 4),
    # BwdTileTraits: the Q_i, dO_i pair [64][64] and lse_i, D_i [64] (dK/dV), float32
    "BwdTileTraits-dkdv": (
        lambda: tiling.simt_backward_plans(64, np.float32)[0],
        (2 * 64 * 64 + 2 * 64) * 4),
    # chunked dQ, d = 300: K_j, V_j [16][256] and Σ S, Σ dP [16 x 16 block rows]
    "BwdTileTraits-dq-chunked": (
        lambda: tiling.simt_backward_plans(300, np.float32)[1],
        (2 * 16 * 256 + 2 * 16 * 16) * 4),
    # TcBwdTraits: own pair [64][64], ring pair [2][64][64] in float16, lse_i, D_i [2][64]
    "TcBwdTraits-dkdv": (
        lambda: _find(tiling.all_tc_bwd_plans((8, 0)), kernel="flash_bwd_dkdv_tc",
                      dtype="float16", head_dim=64, dq_parts=False),
        (2 * 64 * 64 + 2 * 2 * 64 * 64) * 2 + 2 * 2 * 64 * 4),
    # with DQ_PARTS (5-GEMM backward): and dSᵀ [128 keys][64 + 8 queries] in float16
    "TcBwdTraits-dkdv-dq-parts": (
        lambda: _find(tiling.all_tc_bwd_plans((9, 0)), kernel="flash_bwd_dkdv_tc",
                      dtype="float16", head_dim=128, dq_parts=True, tile_rows=64),
        (2 * 128 * 128 + 2 * 2 * 64 * 128 + 128 * 72) * 2 + 2 * 2 * 64 * 4),
    "TcBwdTraits-dq": (
        lambda: _find(tiling.all_tc_bwd_plans(), kernel="flash_bwd_dq_tc", dtype="float16",
                      head_dim=128),
        (2 * 64 * 128 + 2 * 2 * 32 * 128) * 2),
    "TcBwdTraits-tf32-dkdv": (
        lambda: _find(tiling.all_tf32_bwd_plans(), kernel="flash_bwd_dkdv_tc", split=True,
                      head_dim=128, chunk_cols=128),
        (2 * 64 * 128 + 2 * 2 * 8 * 128) * 4 + 2 * 2 * 8 * 4),
}


@pytest.mark.parametrize("case", list(SMEM_CASES))
def test_smem_formula_by_hand(case):
    plan, expected = SMEM_CASES[case]
    assert plan().smem_bytes == expected


# -- plans without ml_dtypes --------------------------------------------------------------

_ENUMERATE = textwrap.dedent("""
    import json, sys
    {block}
    from cuflash import tiling
    out = {{"plans": {{n: [str(p), p.smem_bytes, p.num_threads, p.source]
                      for n, p in tiling.every_plan().items()}},
           "specs": tiling.specializations(), "paths": []}}
    for cc, smem in (((8, 0), 163 * 1024), ((7, 5), 64 * 1024), ((12, 0), 101376),
                     (None, 64 * 1024)):
        for d in (64, 100, 128, 256, 300):
            for dt in ("bfloat16", "float16", "float32"):
                fwd = tiling.forward_path(d, dt, cc, max_smem=smem)
                bwd = tiling.backward_path(d, dt, cc, max_smem=smem)
                out["paths"].append([fwd[0].name_expression, fwd[1],
                                     [p.name_expression for p in bwd[0]], bwd[1]])
    print(json.dumps(out))
""")


def _enumerate(block_ml_dtypes):
    block = 'sys.modules["ml_dtypes"] = None' if block_ml_dtypes else "import ml_dtypes"
    run = subprocess.run([sys.executable, "-c", _ENUMERATE.format(block=block)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_plans_enumerable_without_ml_dtypes():
    """Every plan, every specialization and the bfloat16 paths, with ml_dtypes blocked, are
    those of a process that has it: what the gate compiles does not depend on the host."""
    pytest.importorskip("ml_dtypes")
    without = _enumerate(block_ml_dtypes=True)
    assert without == _enumerate(block_ml_dtypes=False)
    names = set(without["plans"])
    bf16 = {n for n in names if "__nv_bfloat16" in n}
    assert bf16 == {n.replace("__half", "__nv_bfloat16") for n in names if "__half" in n}
    assert any("flash_fwd_tc_kernel<__nv_bfloat16" in p[0] for p in without["paths"])


def test_bad_dtype_is_a_type_error():
    for path in (tiling.forward_path, tiling.backward_path):
        with pytest.raises(TypeError, match="dtype must be one of .*; got int32"):
            path(64, np.int32, (8, 0), max_smem=163 * KIB)


# -- Blackwell: sm_100 (B200) and sm_120 (RTX 50xx) run the mma.sync plans -----------------

B200 = dict(cc=(10, 0), max_smem=232448)       # 227 KB opt-in, as H100 (sm_90)
RTX_50 = dict(cc=(12, 0), max_smem=101376)     # 99 KB opt-in, as sm_86 / sm_89


def test_blackwell_takes_tensor_cores():
    for dev, sm in ((B200, "sm_100"), (RTX_50, "sm_120")):
        for dt in (np.float16, "bfloat16", np.float32):
            for d in (64, 96, 128, 256):
                for allow_tf32 in (False, True):
                    fwd, why = tiling.forward_path(d, dt, allow_tf32=allow_tf32, **dev)
                    assert fwd.kernel.startswith("flash_fwd_t") and sm in why, why
                    (dkdv, dq), why = tiling.backward_path(d, dt, allow_tf32=allow_tf32, **dev)
                    assert isinstance(dkdv, tiling.TcBwdPlan) and sm in why, why
                    assert max(fwd.smem_bytes, dkdv.smem_bytes, dq.smem_bytes) <= dev["max_smem"]
        assert "mma.m16n8k16" in tiling.forward_path(64, np.float16, **dev)[1]


def test_blackwell_tiles_by_shared_memory():
    """The tile follows the opt-in limit: float32 one-pass D = 128 is 128x32 with 8 warps,
    (128·128 + 2·2·32·128)·4 = 131072 bytes, within B200's 232448; the RTX 50's 101376
    take 64x32 with 4 warps, (64·128 + 2·2·32·128)·4 = 98304 bytes."""
    big = tiling.forward_path(128, np.float32, allow_tf32=True, **B200)[0]
    small = tiling.forward_path(128, np.float32, allow_tf32=True, **RTX_50)[0]
    assert (big.block_m, big.block_n, big.num_warps, big.smem_bytes) == (128, 32, 8, 131072)
    assert (small.block_m, small.block_n, small.num_warps, small.smem_bytes) == (64, 32, 4, 98304)
    # d = 256, bfloat16 dK/dV: 8 warps, 128 keys, (2·128·256 + 2·2·16·256)·2 + 2·2·16·4 =
    # 164096 bytes on B200; 4 warps, 64 keys, (2·64·256 + 2·2·16·256)·2 + 256 = 98560 bytes
    # on the RTX 50
    (big, _), _ = tiling.backward_path(256, "bfloat16", **B200)
    (small, _), _ = tiling.backward_path(256, "bfloat16", **RTX_50)
    assert (big.num_warps, big.block_rows, big.smem_bytes) == (8, 128, 164096)
    assert (small.num_warps, small.block_rows, small.smem_bytes) == (4, 64, 98560)


def test_every_plan_of_a_device_holds_what_it_chooses():
    """every_plan(cc), what the gate compiles for an arch, holds every plan the choosers
    take there; every_plan() holds those of every device."""
    for cc, max_smem in (((7, 5), 64 * KIB), ((8, 0), 163 * KIB), ((8, 6), 99 * KIB),
                         ((9, 0), 227 * KIB), ((10, 0), 232448), ((12, 0), 101376)):
        listed = tiling.every_plan(cc)
        assert set(listed) <= set(tiling.every_plan())
        for dt in ("float16", "bfloat16", "float32", "float64"):
            for d in (32, 64, 100, 128, 256, 300):
                for allow_tf32 in (False, True):
                    fwd, _ = tiling.forward_path(d, dt, cc, max_smem=max_smem,
                                                 allow_tf32=allow_tf32)
                    bwd, _ = tiling.backward_path(d, dt, cc, max_smem=max_smem,
                                                  allow_tf32=allow_tf32)
                    for plan in (fwd, *bwd):
                        assert listed.get(plan.name_expression) == plan, (cc, str(plan))


def _have_sm120_toolchain():
    try:
        from cuflash import compile_gate
        compile_gate.ptxas_path()
        return "sm_120" in compile_gate.nvrtc_archs()
    except Exception:
        return False


@pytest.mark.skipif(not _have_sm120_toolchain(), reason="no NVRTC and ptxas for sm_120")
def test_sm120_plans_do_not_spill():
    """ptxas for sm_120 spills split-tf32 tiles that sm_80..sm_100 hold in registers: the
    plans sm_120 takes, forward and backward, compile there with no local memory."""
    from cuflash import compile_gate
    chosen = {}
    for d in tiling.TF32_HEAD_DIMS:
        for allow_tf32 in (False, True):
            fwd, _ = tiling.forward_path(d, np.float32, allow_tf32=allow_tf32, **RTX_50)
            bwd, _ = tiling.backward_path(d, np.float32, allow_tf32=allow_tf32, **RTX_50)
            for plan in (fwd, *bwd):
                chosen.setdefault(plan.source, set()).add(plan.name_expression)
    rows = compile_gate.run_gate({src: sorted(n) for src, n in chosen.items()},
                                 archs=["sm_120"])
    assert len(rows) == sum(map(len, chosen.values()))
    for r in rows:
        assert r.ok, (r.kernel, r.status)


def test_device_limits_reads_three_digit_compute_capabilities(monkeypatch):
    class Device:
        attributes = {"MaxSharedMemoryPerBlockOptin": 101376, "MultiProcessorCount": 170}
        compute_capability = "120"

    class Cuda:
        pass

    cupy = type(sys)("cupy")
    cupy.cuda = Cuda()
    cupy.cuda.Device = Device
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert tiling.device_limits() == {"max_smem": 101376, "sm_count": 170, "cc": (12, 0),
                                      "sm90a": False}
    Device.compute_capability = "100"
    assert tiling.device_limits()["cc"] == (10, 0)
    assert not tiling.device_limits()["sm90a"]      # sm_90a code runs on 9.0 alone
    Device.compute_capability = "90"
    assert tiling.device_limits()["sm90a"]


# -- split-KV -----------------------------------------------------------------------------

def test_split_kv_calls_with_an_empty_batch():
    """No (row, head) tile at all: nothing to split (not a division by zero)."""
    assert tiling.split_kv_calls(108, 0, 8, 1, 4096) == 1
    q = np.zeros((0, 2, 1, 8), np.float32)
    cache = np.zeros((0, 2, 16, 8), np.float32)
    o = kvcache.flash_attention_with_kvcache(q, cache, cache,
                                             cache_seqlens=np.zeros(0, np.int32))
    assert o.shape == q.shape
