"""The static cost of the tensor-core main loops (cuflash.sass_cost) and its place in the
compile gate: the parser, CFG and loop finder on hand-written listings with hand-counted
figures; the real fp16 builds against what their tiles imply, with today's instructions
per HMMA as ceilings; the refusal of a main loop whose softmax is rolled."""
import dataclasses
import json

import pytest

from conftest import have_toolchain
from cuflash import compile_gate, sass_cost, tiling

# -- hand-written listings, in nvdisasm's syntax ---------------------------------------------

# A loop left by ptxas's jump forms: a predicated CALL.REL.NOINC to a local label (the exit,
# never returns), a call to a subroutine (returns), a predicated instruction, a predicated
# EXIT before the loop, the self-branch padding after the end.
JUMPS = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x80, PT ;
        /*0020*/               @P0 EXIT ;
.L_x_0:
        /*0030*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/               @P1 FMUL.FTZ R8, R8, R9 ;
        /*0060*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm3x_div_rn_ftz_f32_slowpath) ;
        /*0070*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0080*/                   ISETP.NE.AND P2, PT, R0, R1, PT ;
        /*0090*/              @!P2 CALL.REL.NOINC `(.L_x_1) ;
        /*00a0*/                   BRA `(.L_x_0) ;
.L_x_1:
        /*00b0*/                   STG.E [R2.64], R8 ;
        /*00c0*/                   EXIT ;
.L_x_2:
        /*00d0*/                   BRA `(.L_x_2);
        /*00e0*/                   NOP;
$__internal_0_$__cuda_sm3x_div_rn_ftz_f32_slowpath:
        /*00f0*/                   FCHK P0, R3, R4 ;
        /*0100*/                   RET.REL.NODEC R10 `(_Z6kernelv) ;
"""

# A rolled inner loop (the softmax: one MUFU.EX2 for 32 scores) inside the main loop, whose
# back edge is a uniform branch with its predicate as an operand (`BRA.U UP0, ...`).
NESTED = """
        /*0000*/                   MOV R20, RZ ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32 R8, R12, R14, RZ ;
        /*0030*/                   HMMA.16816.F32 R16, R12, R15, RZ ;
        /*0040*/                   IMAD.MOV.U32 R21, RZ, RZ, RZ ;
.L_x_1:
        /*0050*/                   FFMA.FTZ R22, R8, R23, -R24 ;
        /*0060*/                   MUFU.EX2 R22, R22 ;
        /*0070*/                   SHFL.BFLY PT, R25, R22, 0x1, 0x1f ;
        /*0080*/                   IADD3 R21, R21, 0x1, RZ ;
        /*0090*/                   ISETP.NE.AND P0, PT, R21, 0x20, PT ;
        /*00a0*/               @P0 BRA `(.L_x_1) ;
        /*00b0*/                   F2FP.PACK_AB R26, R22, R25 ;
        /*00c0*/                   HMMA.16816.F32 R28, R26, R14, R28 ;
        /*00d0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00e0*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*00f0*/                   UISETP.NE.AND UP0, UPT, UR4, UR5, UPT ;
        /*0100*/                   BRA.U UP0, `(.L_x_0) ;
        /*0110*/                   EXIT ;
"""

# The steady state skips the optional masking block but not the predicated tile copy.
MASKED = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   ISETP.GE.AND P0, PT, R0, R1, PT ;
        /*0020*/               @P0 BRA `(.L_x_1) ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R2+0x800], desc[UR4][R4.64+0x80] ;
.L_x_1:
        /*0050*/                   LDGDEPBAR ;
        /*0060*/                   HMMA.16816.F32 R8, R12, R14, RZ ;
        /*0070*/                   FMUL.FTZ R8, R8, R15 ;
        /*0080*/              @!P1 BRA `(.L_x_2) ;
        /*0090*/                   VIADD R16, R17, 0x1 ;
        /*00a0*/                   ISETP.GT.AND P2, PT, R16, R18, PT ;
        /*00b0*/                   FSEL R8, R8, -INF , !P2 ;
        /*00c0*/                   ISETP.GT.AND P3, PT, R16, R19, PT ;
        /*00d0*/                   FSEL R9, R9, -INF , !P3 ;
.L_x_2:
        /*00e0*/                   MUFU.EX2 R8, R8 ;
        /*00f0*/                   MUFU.EX2 R9, R9 ;
        /*0100*/                   HMMA.16816.F32 R20, R8, R14, R20 ;
        /*0110*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0120*/                   ISETP.NE.AND P4, PT, R0, R5, PT ;
        /*0130*/               @P4 BRA `(.L_x_0) ;
        /*0140*/                   EXIT ;
"""


# A worker's walk (the 5-GEMM dK/dV kernel): an outer loop around the main loop, holding
# more HMMA (one in its epilogue) but not the main loop; the main loop's red.add to the dQ
# partial sit in a block its bounds test may skip, and count.
WALKED = """
        /*0000*/                   MOV R20, RZ ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   HMMA.16816.F32 R8, R12, R14, R8 ;
        /*0050*/                   HMMA.16816.F32 R16, R12, R15, R16 ;
        /*0060*/               @P0 BRA `(.L_x_2) ;
        /*0070*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R6.64], R8 ;
        /*0080*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R6.64+0x4], R9 ;
.L_x_2:
        /*0090*/                   IADD3 R21, R21, 0x1, RZ ;
        /*00a0*/                   ISETP.NE.AND P1, PT, R21, R22, PT ;
        /*00b0*/               @P1 BRA `(.L_x_1) ;
        /*00c0*/                   HMMA.16816.F32 R24, R12, R14, RZ ;
        /*00d0*/                   STG.E [R2.64], R24 ;
        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00f0*/                   IADD3 R20, R20, 0x1, RZ ;
        /*0100*/                   ISETP.NE.AND P2, PT, R20, R23, PT ;
        /*0110*/               @P2 BRA `(.L_x_0) ;
        /*0120*/                   EXIT ;
"""


def _cfg(text):
    """[(first address, instructions, successors' first addresses)] of each block."""
    blocks = sass_cost.basic_blocks(*sass_cost.parse_function(text))
    first = [b.instructions[0].address for b in blocks]
    return [(first[i], len(b.instructions), [first[s] for s in b.successors])
            for i, b in enumerate(blocks)]


def _counts(**nonzero):
    return {c: nonzero.get(c, 0) for c in sass_cost.CLASSES}


def test_jump_forms():
    assert _cfg(JUMPS) == [
        (0x00, 3, [0x30]),            # @P0 EXIT falls through
        (0x30, 7, [0xb0, 0xa0]),      # the CALL to .L_x_1 leaves; the subroutine call returns
        (0xa0, 1, [0x30]),            # the back edge
        (0xb0, 2, []),
        (0xd0, 1, []),                # padding: a branch to itself
        (0xe0, 3, []),                # a NOP, then the subroutine: never reached
    ]
    cost = sass_cost.loop_cost(JUMPS)
    assert (cost.found, cost.loop_blocks, cost.path_blocks, cost.total) == (True, 2, 2, 8)
    # the two CALLs and the BRA are branches; @P1 FMUL counts
    assert cost.counts == _counts(**{"LDSM": 1, "HMMA": 1, "FP32": 1, "int/addr": 2,
                                     "branch/barrier": 3})
    assert cost.per_hmma == 8.0


def test_nested_rolled_loop_is_entered_once():
    assert _cfg(NESTED) == [
        (0x00, 1, [0x10]),
        (0x10, 4, [0x50]),
        (0x50, 6, [0x50, 0xb0]),      # the inner loop
        (0xb0, 6, [0x10, 0x110]),     # BRA.U UP0: both edges
        (0x110, 1, []),
    ]
    cost = sass_cost.loop_cost(NESTED)
    assert (cost.found, cost.loop_blocks, cost.path_blocks, cost.total) == (True, 3, 3, 16)
    assert cost.counts == _counts(**{"LDGSTS": 1, "HMMA": 3, "move": 1, "FP32": 1,
                                     "MUFU.EX2": 1, "SHFL": 1, "int/addr": 2,
                                     "branch/barrier": 3, "conversion": 1, "uniform": 2})
    assert cost.hmma == 3 and cost.mufu_ex2 == 1


def test_cheapest_path_skips_the_mask_and_keeps_the_copy():
    cost = sass_cost.loop_cost(MASKED)
    # 0x10 (2) → 0x30, the copy (2) → 0x50 (4) → 0xe0 (6); not 0x90, the mask (5)
    assert (cost.found, cost.loop_blocks, cost.path_blocks, cost.total) == (True, 5, 4, 14)
    assert cost.counts == _counts(**{"LDGSTS": 2, "HMMA": 2, "FP32": 1, "MUFU.EX2": 2,
                                     "int/addr": 3, "branch/barrier": 4})
    assert cost.per_hmma == 7.0


@pytest.mark.parametrize("red", ["RED.E.ADD", "REDG.E.ADD", "UBLKRED.G.S.ADD"],
                         ids=["sm_80", "sm_90", "sm_90 bulk"])
def test_main_loop_inside_a_walk_and_its_reductions(red):
    # (sm_90's ptxas spells the global reduction REDG, with a descriptor; a bulk reduce-add
    # from shared memory is UBLKRED)
    cost = sass_cost.loop_cost(WALKED.replace("RED.E.ADD", red))
    # the inner loop: 0x30 (4) → 0x70, the red.add (2) → 0x90 (3); not the outer loop's
    # 3 HMMA, and not the cheaper path around the red.add
    assert (cost.found, cost.loop_blocks, cost.path_blocks, cost.total) == (True, 3, 3, 9)
    assert cost.counts == _counts(**{"HMMA": 2, "LDG/STG": 2, "int/addr": 2,
                                     "branch/barrier": 3})


def test_main_loop_waiting_on_an_mbarrier_inside_a_walk():
    """A Hopper loop waits on its ring's mbarriers (SYNCS), not a BAR: the tile walk around
    it, with one consumer warpgroup and so no named barrier inside, is still not the main
    loop."""
    text = WALKED.replace("/*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0",
                          "/*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3")
    cost = sass_cost.loop_cost(text)
    assert (cost.found, cost.loop_blocks, cost.path_blocks, cost.total) == (True, 3, 3, 9)
    assert cost.hmma == 2


def test_hgmma_counts_as_the_hmma_it_equals():
    """A warpgroup MMA's shape is in its opcode (lower-case x's): HGMMA.64x128x16 is 16
    HMMA.16816 of work per warp (16 rows x 128 x 16), HGMMA.64x64x16 8; the instruction
    count is unchanged."""
    text = JUMPS.replace("HMMA.16816.F32 R8, R4, R6, R8",
                         "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24, gsb0")
    text = text.replace("@P1 FMUL.FTZ R8, R8, R9", "HGMMA.64x64x16.F32.BF16 R88, R4, gdesc[UR8], R88")
    cost = sass_cost.loop_cost(text)
    assert cost.counts["HMMA"] == 2 and cost.hmma == 16 + 8
    assert cost.per_hmma == 8 / 24
    assert sass_cost.mma_work("HMMA.16816.F32") == 1 and sass_cost.mma_work("HMMA.1688.F32") == 1


def test_no_loop_holding_an_mma():
    text = JUMPS.replace("HMMA.16816.F32 R8, R4, R6, R8", "FFMA R8, R4, R6, R8")
    assert sass_cost.loop_cost(text) == sass_cost.NO_LOOP
    assert not sass_cost.NO_LOOP.found and sass_cost.NO_LOOP.per_hmma is None


# -- the exp2 a tile needs, and the refusal --------------------------------------------------

def _plan(kernel, dtype, head_dim, cc=None, dq_parts=False, **fields):
    """The one plan of these fields a device of compute capability `cc` (None: any) has
    (dK/dV: with DQ_PARTS or not)."""
    plans = [p for p in tiling.every_plan(cc).values() if p.kernel == kernel
             and p.dtype == dtype and p.head_dim == head_dim
             and getattr(p, "dq_parts", False) == dq_parts
             and all(getattr(p, k) == v for k, v in fields.items())]
    assert len(plans) == 1, plans
    return plans[0]


# One exp2 per score; the scores of one iteration over the threads (hand-worked from the
# tiles in cuflash/plans/tc_fwd.py and tc_bwd.py).
EXP2_PER_THREAD = [
    (("flash_fwd_tc", "float16", 64), 64),     # 128 × 64 scores, 128 threads
    (("flash_fwd_tc", "float16", 128), 32),    # 128 × 32, 128
    (("flash_fwd_tc", "float16", 256), 8),     # 64 × 16, 128
    (("flash_bwd_dkdv_tc", "float16", 64), 32),   # 64 keys × 64 queries, 128
    (("flash_bwd_dkdv_tc", "float16", 128), 8),   # 64 × 16, 128
    (("flash_bwd_dq_tc", "float16", 64), 32),     # 64 queries × 64 keys, 128
    (("flash_bwd_dq_tc", "float16", 128), 16),    # 64 × 32, 128
]


@pytest.mark.parametrize("key, need", EXP2_PER_THREAD, ids=lambda x: "-".join(map(str, x))
                         if isinstance(x, tuple) else str(x))
def test_exp2_needed(key, need):
    assert sass_cost.exp2_needed(_plan(*key, cc=(8, 0))) == need


def test_exp2_needed_dq_parts():
    # the 5-GEMM dK/dV tiles, 256 threads: D = 64, 128 keys × 128 queries (64 on the 99 KB
    # GPUs); D = 128, 128 × 64 (16 on the 99 KB GPUs)
    for rows, need in ((128, 64), (64, 32)):
        assert sass_cost.exp2_needed(_plan("flash_bwd_dkdv_tc", "float16", 64, cc=(8, 0),
                                           dq_parts=True, tile_rows=rows)) == need
    for rows, need in ((64, 32), (16, 8)):
        assert sass_cost.exp2_needed(_plan("flash_bwd_dkdv_tc", "float16", 128, cc=(8, 0),
                                           dq_parts=True, tile_rows=rows)) == need


def test_exp2_needed_sm75():
    # sm_75's own dK/dV tile at D = 64: 64 keys × 32 queries, 128 threads
    assert sass_cost.exp2_needed(_plan("flash_bwd_dkdv_tc", "float16", 64, cc=(7, 5))) == 16


def test_exp2_needed_float32():
    # split tf32, 128 × 32 with 8 warps: 16 (sm_120's 128 × 16: 8); one-pass D = 256,
    # 64 × 8 with 4 warps: 4; the split dQ D = 128, 64 queries × 8 keys, 4 warps: 4
    assert sass_cost.exp2_needed(_plan("flash_fwd_tc", "float32", 64, split=True,
                                       block_n=32)) == 16
    assert sass_cost.exp2_needed(_plan("flash_fwd_tc", "float32", 64, split=True,
                                       block_n=16)) == 8
    assert sass_cost.exp2_needed(_plan("flash_fwd_tc", "float32", 256, split=False,
                                       block_n=8)) == 4
    assert sass_cost.exp2_needed(_plan("flash_bwd_dq_tc", "float32", 128, split=True)) == 4


# float32 one-pass D = 256 with 64 × 8 tiles: 4 exp2 per thread and iteration
SMALL_TILE = "flash_fwd_tc_kernel<float, 256, 64, 8, 4, 2, false>"


def _row(listing, kernel=SMALL_TILE):
    return compile_gate.Row("flash_fwd_tc.cu", kernel, "sm_80", registers=128, smem=0,
                            spill_stores=0, spill_loads=0,
                            sass=dict.fromkeys(compile_gate.SASS_OPCODES, 0),
                            cost=sass_cost.loop_cost(listing))


def test_rolled_softmax_fails_the_gate():
    assert SMALL_TILE in tiling.every_plan()
    rolled = _row(NESTED)             # 1 MUFU.EX2 on the path, 4 needed
    assert rolled.rolled_softmax and not rolled.ok
    assert rolled.status.startswith("ROLLED SOFTMAX") and "4" in rolled.status
    # the same loop with its four exp2 in line passes
    unrolled = NESTED.replace("        /*0060*/                   MUFU.EX2 R22, R22 ;\n",
                              "        /*0060*/                   MUFU.EX2 R22, R22 ;\n" * 4)
    assert _row(unrolled).cost.mufu_ex2 == 4
    assert _row(unrolled).ok and _row(unrolled).status == "ok"
    # kernels that are not tensor-core plans have no requirement
    assert _row(NESTED, kernel="heavy<512>").ok


def test_cost_round_trips_through_the_cache_and_prints():
    row = _row(MASKED)
    back = compile_gate.Row(**json.loads(json.dumps([dataclasses.asdict(row)]))[0])
    assert back == row and isinstance(back.cost, sass_cost.LoopCost)
    row = _row(MASKED, kernel="heavy<512>")   # no plan: no blocks per SM, status ok
    table = compile_gate.format_table([row, dataclasses.replace(row, cost=None)])
    head, costed, plain = table.splitlines()
    assert " ".join(compile_gate.COST_COLUMNS) in " ".join(head.split())
    # loop, loop HMMA, EX2, int/addr, instr/HMMA; then blocks/SM, warps/SM, status
    assert costed.split()[-8:-3] == ["14", "2", "2", "3", "7.00"]
    assert plain.split()[-8:-3] == ["-"] * 5


# -- the real fp16 builds (the gate's cached sm_80 and sm_90 builds) ------------------------

ARCHS = ("sm_80", "sm_90")
# "flash_bwd_dkdv_tc+dq": the 5-GEMM backward's dK/dV kernel (DQ_PARTS), the default
KERNELS = ("flash_fwd_tc", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc", "flash_bwd_dkdv_tc+dq")
CASES = [(k, D, a) for k in KERNELS for D in (64, 128) for a in ARCHS]

# Instructions per HMMA of one steady-state iteration today (instructions / HMMA): ceilings,
# to be lowered as the loops get leaner; a change may exceed one by 2% at most.
# FlashAttention-2's own kernels, built from its source and counted the same way: forward
# 4.63 / 4.59 (D = 64, sm_80 / sm_90) and 3.68 / 3.67 (D = 128); backward 3.52 / 3.42
# (D = 64) and 2.78 / 2.73 (D = 128), its one kernel for dK, dV and dQ. The forward's
# iteration is the one in which no row's max moves (acc *= α skipped: tc_tile.cuh).
CEILING = {
    ("flash_fwd_tc", 64, "sm_80"): 566 / 128, ("flash_fwd_tc", 64, "sm_90"): 564 / 128,
    ("flash_fwd_tc", 128, "sm_80"): 487 / 128, ("flash_fwd_tc", 128, "sm_90"): 488 / 128,
    ("flash_bwd_dkdv_tc", 64, "sm_80"): 510 / 128, ("flash_bwd_dkdv_tc", 64, "sm_90"): 499 / 128,
    ("flash_bwd_dkdv_tc", 128, "sm_80"): 292 / 64, ("flash_bwd_dkdv_tc", 128, "sm_90"): 280 / 64,
    ("flash_bwd_dq_tc", 64, "sm_80"): 449 / 96, ("flash_bwd_dq_tc", 64, "sm_90"): 461 / 96,
    ("flash_bwd_dq_tc", 128, "sm_80"): 402 / 96, ("flash_bwd_dq_tc", 128, "sm_90"): 408 / 96,
    ("flash_bwd_dkdv_tc+dq", 64, "sm_80"): 1083 / 320,
    ("flash_bwd_dkdv_tc+dq", 64, "sm_90"): 1047 / 320,
    ("flash_bwd_dkdv_tc+dq", 128, "sm_80"): 899 / 320,
    ("flash_bwd_dkdv_tc+dq", 128, "sm_90"): 872 / 320,
}


def _case_id(case):
    return "{}-D{}-{}".format(*case)


def _disassembled_rows(archs, sources):
    """The gate's (cached) builds of `sources` for `archs`, disassembled and costed; the
    test skipped where the toolchain or nvdisasm is missing."""
    if not have_toolchain():
        pytest.skip("NVRTC or ptxas not installed")
    if compile_gate.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    return compile_gate.run_gate(archs=archs, sass=True, only=sources)


@pytest.fixture(scope="module")
def fp16_rows():
    rows = _disassembled_rows(ARCHS, ("flash_fwd_tc.cu", "flash_bwd_tc.cu"))
    out = {}
    for r in rows:
        p = tiling.every_plan()[r.kernel]
        if p.dtype == "float16" and getattr(p, "head_dim", None) in (64, 128):
            if getattr(p, "dq_parts", False):   # the 5-GEMM tile sm_80 and sm_90 take
                if p != _default_backward(p.head_dim, r.arch)[0]:
                    continue
                key = (p.kernel + "+dq", p.head_dim, r.arch)
            else:
                key = (p.kernel, p.head_dim, r.arch)
            assert key not in out
            out[key] = (p, r)
    return out


def _default_backward(D, arch):
    """The fp16 backward's plans on `arch` ("sm_80") with its shared memory (227 KB on
    sm_90, 163 KB on sm_80)."""
    cc = compile_gate.arch_cc(arch)
    smem = {(8, 0): 163 * 1024, (9, 0): 227 * 1024}[cc]
    return tiling.backward_path(D, "float16", cc, max_smem=smem, sm_count=100)[0]


def _mma_per_warp(p):
    """HMMA (m16n8k16) of one iteration per warp, from the tile: each GEMM's M / 16 · N / 8
    · K / 16 over the warp's rows."""
    if p.kernel == "flash_fwd_tc":   # S = Q Kᵀ (16R × Bc × D), acc += P̃ V (16R × D × Bc)
        return 2 * p.row_tiles * (p.block_n // 8) * (p.head_dim // 16)
    s = (p.tile_rows // 8) * (p.head_dim // 16)      # 16 own rows × tile × D: S, dP
    x = (p.chunk_cols // 8) * (p.tile_rows // 16)    # 16 own rows × cols × tile
    if p.kernel == "flash_bwd_dq_tc":
        return 2 * s + x                             # dQ
    # dV, dK; with DQ_PARTS dQ_i = dS K_j too, (tile × D × block rows) over the warps
    dq = p.tile_rows * p.head_dim * p.block_rows // (16 * 8 * 16) // p.num_warps
    return 2 * s + 2 * x + (dq if p.dq_parts else 0)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_main_loop_mma_and_ceiling(fp16_rows, case):
    p, r = fp16_rows[case]
    assert r.cost is not None and r.cost.found, (r.kernel, r.arch)
    assert r.cost.hmma == _mma_per_warp(p), (r.kernel, r.arch, r.cost)
    assert r.cost.per_hmma <= CEILING[case] * 1.02, (r.kernel, r.arch, r.cost.per_hmma,
                                                     CEILING[case])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_main_loop_has_an_exp2_per_score(fp16_rows, case):
    p, r = fp16_rows[case]
    need = sass_cost.exp2_needed(p)
    assert r.cost.mufu_ex2 >= need, (r.kernel, r.arch, r.cost.mufu_ex2, need)
    assert not r.rolled_softmax, r.status


@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("cc", ((8, 0), (9, 0)))
def test_default_backward_runs_five_gemms(fp16_rows, D, cc):
    # the default fp16 backward is the 5-GEMM one: per block of keys × queries × D its
    # iterations issue the HMMA of five (S, dP, dV, dK, dQ), each keys · queries · D / (16 ·
    # 8 · 16) of them, and no dQ kernel recomputes S and dP
    arch = f"sm_{cc[0]}{cc[1]}"
    dkdv, dq = _default_backward(D, arch)
    assert dkdv.dq_parts and isinstance(dq, tiling.DqSumPlan)
    p, r = fp16_rows[("flash_bwd_dkdv_tc+dq", D, arch)]
    assert p == dkdv
    per_gemm = p.block_rows * p.tile_rows * p.head_dim // (16 * 8 * 16)
    assert r.cost.hmma * p.num_warps == 5 * per_gemm


# -- the Hopper kernels (sm_90a: an HGMMA counted as the HMMA.16816 it equals per warp) -----

# Instructions per HMMA of one consumer warp's steady-state iteration, fp16 (float32 below),
# as ceilings (a change may exceed one by 2% at most): the forward per key tile (128 keys;
# 64 at D = 256), the dK/dV pass per 64-query step, the dQ pass per 64-key tile.
# FlashAttention-3's forward
# consumer loop at D = 128, built from its source and counted the same way: 1.65 (176-key
# tiles). HMMA-equivalents per iteration: the tile's GEMMs over the warpgroup's 4 warps.
HOPPER_CEILING = {
    ("flash_fwd_sm90_kernel", 64): (392 / 128, 128), ("flash_fwd_sm90_kernel", 128): (421 / 256, 256),
    ("flash_fwd_sm90_kernel", 256): (331 / 256, 256),
    ("flash_bwd_dkdv_sm90_kernel", 64): (302 / 128, 128),
    ("flash_bwd_dkdv_sm90_kernel", 128): (327 / 256, 256),
    ("flash_bwd_dq_sm90_kernel", 64): (236 / 96, 96), ("flash_bwd_dq_sm90_kernel", 128): (247 / 192, 192),
    # float32 as one-pass tf32: 64-key tiles, an HGMMA .tf32 counted as the HMMA.16816 of
    # its multiply-adds (the tensor cores take twice as long over them)
    ("flash_fwd_sm90_kernel", 64, "float"): (283 / 64, 64),
    ("flash_fwd_sm90_kernel", 128, "float"): (339 / 128, 128),
    ("flash_fwd_sm90_kernel", 64, "float", "split"): (484 / 192, 192),   # three products each
    # one consumer warpgroup, 32-key tiles: split at D = 128, one-pass at 256
    ("flash_fwd_sm90_kernel", 128, "float", "split"): (441 / 192, 192),
    ("flash_fwd_sm90_kernel", 256, "float"): (347 / 128, 128),
    # five GEMMs (the default, and deterministic=False): dQ's part by a bulk reduce-add (the
    # path through the thread that issues it)
    ("flash_bwd_dkdv_sm90_kernel", 64, "parts"): (363 / 160, 160),
    ("flash_bwd_dkdv_sm90_kernel", 128, "parts"): (411 / 320, 320),
}


@pytest.fixture(scope="module")
def hopper_rows():
    rows = _disassembled_rows(("sm_90a",), ("flash_fwd_sm90.cu", "flash_bwd_sm90.cu"))
    out = {}
    for r in rows:
        kernel, _, args = r.kernel.partition("<")
        args = [a.strip() for a in args.rstrip(">").split(",")]
        key = (kernel, int(args[1])) + (("float",) if args[0] == "float" else ())
        parts = kernel == "flash_bwd_dkdv_sm90_kernel" and args[2:] == ["true"]   # DQ_PARTS
        if parts and args[0] == "__half":
            out[key + ("parts",)] = r
        elif args[0] in ("__half", "float") and args[2:3] in ([], ["false"]):   # padded rows
            out[key + (("split",) if args[3:] == ["true"] else ())] = r
    return out


@pytest.mark.parametrize("case", sorted(HOPPER_CEILING),
                         ids=lambda c: f"{c[0]}-D{c[1]}" + "".join(f"-{x}" for x in c[2:]))
def test_hopper_loop_ceiling(hopper_rows, case):
    ceiling, work = HOPPER_CEILING[case]
    r = hopper_rows[case]
    assert r.ok, r.status   # 0 spills, HGMMA, UTMALDG, SYNCS, the wgmma not serialized
    assert r.cost is not None and r.cost.found and r.cost.hmma == work, (r.kernel, r.cost)
    assert r.cost.per_hmma <= ceiling * 1.02, (r.kernel, r.cost.total, r.cost.per_hmma, ceiling)
