"""The compile gate: every specialization compiles with NVRTC for every gate arch and
assembles with ptxas without spilling — and the gate itself can fail.

The full run is cached on disk (keyed by source + headers + options + names + the NVRTC
and ptxas builds), so only the first run after a kernel edit pays the cold compile.
"""
import subprocess
import sys

import pytest

from conftest import have_toolchain
from cuflash import compile_gate, compiler, tiling

pytestmark = pytest.mark.skipif(not have_toolchain(), reason="NVRTC or ptxas not installed")


@pytest.fixture(scope="module")
def gate_rows():
    # with the disassembly where nvdisasm is installed, as `check-kernels` runs it: the
    # kernel tests' SASS checks then find these builds in the cache
    return compile_gate.run_gate(sass=compile_gate.nvdisasm_path() is not None)


def test_every_specialization_compiles_without_spills(gate_rows):
    bad = [r for r in gate_rows if not r.ok]
    assert not bad, "\n" + compile_gate.format_table(bad) + "\n" + (bad[0].error or "")


def test_gate_covers_every_arch_and_backward_kernel(gate_rows):
    archs, _ = compile_gate.gate_archs()
    seen = {(r.kernel, r.arch) for r in gate_rows}
    for name in tiling.specializations()["flash_bwd.cu"]:
        for arch in archs:
            if arch not in compile_gate.SPECIFIC:   # sm_90a builds its own kernels alone
                assert (name, arch) in seen
    for arch, specs in compile_gate.SPECIFIC.items():
        if arch in archs:
            assert {(name, arch) for names in specs.values() for name in names} <= seen


def test_backward_smem_formula_matches_ptxas(gate_rows):
    """The Python plan's shared-memory bytes are what ptxas reports for the kernel."""
    by_name = {(r.kernel, r.arch): r for r in gate_rows}
    for p in tiling.all_simt_bwd_plans():
        for arch in compile_gate.gate_archs()[0]:
            if arch not in compile_gate.SPECIFIC:
                assert by_name[(p.name_expression, arch)].smem == p.smem_bytes, str(p)


PLANTED = r"""
template <int N>
__global__ void heavy(const float* __restrict__ x, float* __restrict__ y) {
    // N live values indexed at run time: more than 255 registers hold → local memory.
    float a[N];
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = x[threadIdx.x * N + i];
    float s = 0.f;
    for (int i = 0; i < N; ++i) s += a[(i * 7 + threadIdx.x) % N] * a[i];
#pragma unroll
    for (int i = 0; i < N; ++i) y[threadIdx.x * N + i] = a[i] * s;
}
template <int N>
__global__ void light(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x] * N; }
"""

BROKEN = r"""
template <typename T>
__global__ void broken(T* y) { y[threadIdx.x] = undefined_function(threadIdx.x); }
"""


def test_gate_detects_a_spill():
    rows = compile_gate.run_gate({"planted.cu": ["heavy<512>", "light<2>"]}, archs=["sm_80"],
                                 use_cache=False, sources={"planted.cu": PLANTED})
    by = {r.kernel: r for r in rows}
    assert by["heavy<512>"].status == "SPILL" and by["heavy<512>"].spill_stores > 0
    assert not by["heavy<512>"].ok
    assert by["light<2>"].ok and by["light<2>"].registers > 0


def test_gate_detects_a_compile_error():
    rows = compile_gate.run_gate({"broken.cu": ["broken<float>"]}, archs=["sm_70"],
                                 use_cache=False, sources={"broken.cu": BROKEN})
    assert len(rows) == 1 and not rows[0].ok
    assert "undefined_function" in rows[0].error


def test_check_kernels_exit_status(capsys):
    # the same builds as the gate_rows fixture (cached): with the disassembly where
    # nvdisasm is installed; the disassembly's counts are tested with the tensor-core kernels
    args = [] if compile_gate.nvdisasm_path() is not None else ["--no-sass"]
    assert compile_gate.check_kernels(["--arch", "sm_80", *args]) == 0
    out = capsys.readouterr().out
    assert "flash_bwd_dkdv_kernel" in out and "sm_80" in out


def test_parse_ptxas():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem, 360 bytes cmem[0]
"""
    info = compile_gate.parse_ptxas(log)
    assert info == {"_Z3fooPf": {"registers": 255, "smem": 16384, "spill_stores": 4,
                                 "spill_loads": 12, "wgmma_serialized": False}}


# ptxas 12.9's words where it serializes a kernel's wgmma (before the function's report)
SERIALIZED_LOG = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 7806 by compiler to allow use of registers in GMMA in function '_Z3barv'
ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.AR in divergent path in the function '_Z3barv'
ptxas info    : 82 bytes gmem
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90a'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 16 bytes smem
ptxas info    : Compiling entry function '_Z3bazv' for 'sm_90a'
ptxas info    : Function properties for _Z3bazv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 16 bytes smem
"""


def test_serialized_wgmma_fail_the_gate():
    """A kernel whose wgmma ptxas serialized (each product waiting for the one before) is
    no Hopper kernel: the gate names it; its neighbour in the same program is fine."""
    info = compile_gate.parse_ptxas(SERIALIZED_LOG)
    assert info["_Z3barv"]["wgmma_serialized"] and not info["_Z3bazv"]["wgmma_serialized"]
    bad = compile_gate.Row("k.cu", "bar", "sm_90a", **info["_Z3barv"])
    good = compile_gate.Row("k.cu", "baz", "sm_90a", **info["_Z3bazv"])
    assert not bad.ok and bad.status == "WGMMA SERIALIZED"
    assert good.ok and good.status == "ok"


# -- architectures the installed NVRTC cannot target --------------------------------------

def test_split_archs_names_what_it_skips_and_why():
    build, skipped = compile_gate.split_archs(("sm_70", "sm_75", "sm_80"),
                                              ("sm_75", "sm_80", "sm_90"), (13, 0))
    assert build == ("sm_75", "sm_80")
    assert list(skipped) == ["sm_70"]
    assert "NVRTC 13.0 cannot target sm_70" in skipped["sm_70"]


# Real architectures `nvrtcGetSupportedArchs` lists, by toolkit (CUDA 13 drops Maxwell,
# Pascal and Volta).
NVRTC_12_6 = ("sm_50", "sm_52", "sm_53", "sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75",
              "sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
NVRTC_12_9 = NVRTC_12_6 + ("sm_100", "sm_101", "sm_103", "sm_120", "sm_121")
NVRTC_13_0 = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103",
              "sm_110", "sm_120", "sm_121")


@pytest.mark.parametrize("version, supported, skipped", [
    ((12, 6), NVRTC_12_6, ("sm_100", "sm_120")),
    ((12, 9), NVRTC_12_9, ()),
    ((13, 0), NVRTC_13_0, ("sm_70",)),
])
def test_gate_archs_are_what_the_toolkit_targets(monkeypatch, version, supported, skipped):
    """Volta through Hopper and Blackwell (B200 sm_100, the consumer sm_120), less what
    the installed NVRTC cannot target, each skipped arch with the toolkit that has it."""
    from cupy.cuda import nvrtc
    monkeypatch.setattr(compile_gate, "nvrtc_archs", lambda: supported)
    monkeypatch.setattr(nvrtc, "getVersion", lambda: version)
    build, why = compile_gate.gate_archs()
    every = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "sm_90a")
    assert build == tuple(a for a in every if a not in skipped)
    assert tuple(why) == skipped
    for arch in skipped:
        assert why[arch].startswith(f"NVRTC {version[0]}.{version[1]} cannot target {arch} (")
        assert ("12.9 is the last" if arch == "sm_70" else "12.8 is the first") in why[arch]


def test_check_kernels_builds_what_it_can_and_lists_the_rest(capsys, monkeypatch):
    """A toolkit without sm_70 (CUDA 13): the gate passes on the archs it can build."""
    monkeypatch.setattr(compile_gate, "nvrtc_archs", lambda: ("sm_75", "sm_80"))
    monkeypatch.setattr(compile_gate, "collect_specializations",
                        lambda arch=None: {"planted.cu": ["light<2>"]})
    monkeypatch.setattr(compiler, "read_source", lambda name: PLANTED)
    assert compile_gate.check_kernels(["--arch", "sm_70", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "light<2>" in out and "1 builds" in out
    assert "skipped sm_70: NVRTC" in out
    # Nothing buildable is a failure, not a silent pass.
    assert compile_gate.check_kernels(["--arch", "sm_70"]) == 1


# A Python without ml_dtypes, as far as imports see (sys.modules["ml_dtypes"] = None would
# also break CuPy, which tells the missing package from a blocked one).
WITHOUT_ML_DTYPES = """import sys
class NoMlDtypes:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "ml_dtypes":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoMlDtypes())
"""


def test_check_kernels_without_ml_dtypes():
    """Without the bf16 extra the gate still builds the bfloat16 kernels: NVRTC needs only
    the C type name __nv_bfloat16, not ml_dtypes' NumPy type."""
    code = WITHOUT_ML_DTYPES + ("from cuflash import cli\n"
                                "sys.exit(cli.main(['check-kernels', '--arch', 'sm_80', "
                                "'--source', 'online_softmax.cu']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [x.split() for x in proc.stdout.splitlines() if "_kernel<" in x]
    assert {r[0] for r in rows} == {"softmax_rows_kernel<__nv_bfloat16,",
                                    "softmax_cols_kernel<__nv_bfloat16,",
                                    "softmax_rows_kernel<__half,", "softmax_cols_kernel<__half,",
                                    "softmax_rows_kernel<float,", "softmax_cols_kernel<float,",
                                    "softmax_rows_kernel<double,", "softmax_cols_kernel<double,"}
    assert all(r[-1] == "ok" for r in rows), proc.stdout


def test_check_kernels_rejects_an_unknown_source(capsys):
    with pytest.raises(SystemExit):
        compile_gate.check_kernels(["--source", "flash_fwd.cuh"])
    err = capsys.readouterr().err
    assert "'flash_fwd.cuh'" in err and "flash_fwd.cu" in err


def test_cache_key_names_the_tools_builds(monkeypatch):
    """The results cache is keyed by the tools' builds, not only their paths: an NVRTC or
    ptxas wheel upgraded in place (same path, same major.minor) must not serve the old
    tools' registers."""
    args = (compiler.read_source("flash_fwd.cu"), ["flash_fwd_kernel<float, 64, 64, 64, 4>"],
            "sm_80", ("-arch=compute_80",))
    key = compile_gate._key(*args)
    assert compile_gate._key(*args) == key
    monkeypatch.setattr(compile_gate, "_tool_version", lambda path: "ptxas V12.9.99")
    assert compile_gate._key(*args) != key
    monkeypatch.undo()
    monkeypatch.setattr(compile_gate, "_nvrtc_wheels", lambda: ("nvidia-cuda-nvrtc-cu12==12.9.1",))
    assert compile_gate._key(*args) != key


def test_block_mask_kernel_is_built_with_a_mask_mod_on_every_arch():
    """block_mask.cu compiles only after a mask_mod's code: the gate builds it with its
    example's, float32 and float64, on each arch (not the sm_90a-only list)."""
    for arch in ("sm_75", "sm_90", "sm_120"):
        specs = compile_gate.collect_specializations(arch)
        assert specs["block_mask.cu+mods_f32"] == specs["block_mask.cu+mods_f64"] == [
            "block_mask_kernel<256>"]
    assert not any("block_mask" in f for f in compile_gate.collect_specializations("sm_90a"))
    rows = compile_gate.run_gate(archs=["sm_75"], only=("block_mask.cu+mods_f32",
                                                        "block_mask.cu+mods_f64"))
    assert len(rows) == 2 and all(r.ok and r.spill_stores == 0 for r in rows), \
        compile_gate.format_table(rows)


def test_check_kernels_selects_a_mods_build(capsys):
    """--source takes the "+mods" builds the gate makes (the kernels with the example
    mods compiled in), not only the plain files."""
    assert compile_gate.check_kernels(["--source", "block_mask.cu+mods_f32", "--arch", "sm_75",
                                       "--no-sass"]) == 0
    out = capsys.readouterr().out
    assert "block_mask_kernel<256> +mods" in out and "1 builds (1 specializations x 1 archs)" in out


# -- sm_90a: the Hopper kernels' machine code ------------------------------------------------

def test_sm90a_gemm_reaches_hopper_machine_code(tmp_path):
    """sm90_gemm.cu, flash_fwd_sm90.cu and flash_bwd_sm90.cu built for sm_90a show warpgroup
    MMA, TMA loads and mbarrier operations in their SASS; with the GEMM's wgmma or its TMA taken out the gate
    fails it, naming what is missing (ptxas turns a lone wgmma.fence/commit/wait into
    placeholder HGMMA: all go)."""
    if compile_gate.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed")
    rows = compile_gate.run_gate(archs=["sm_90a"], sass=True, use_cache=False)
    generated = [r for r in rows if "+mods" in r.source]   # a score_mod / mask_mod compiled in
    assert {r.kernel for r in generated} == {f"flash_{p}_sm90_kernel<{t}, {d}>" for p, d in (
        ("fwd", "256, true"), ("bwd_dkdv", 128), ("bwd_dq", 128))
        for t in ("__half", "__nv_bfloat16")} | {"flash_fwd_sm90_kernel<float, 256, true>"}
    assert [r.kernel for r in rows if r not in generated] == ["sm90_gemm"] + [
        f"flash_fwd_sm90_kernel<{t}, {d}, {varlen}{split}>" for t, dims, split in (
            ("__half", (64, 128, 256), ""), ("__nv_bfloat16", (64, 128, 256), ""),
            ("float", (64, 128), ", true"), ("float", (64, 128, 256), ""))
        for d in dims for varlen in ("false", "true")] + [
        f"flash_bwd_{p}_sm90_kernel<{t}, {d}{parts}>" for t in ("__half", "__nv_bfloat16")
        for d in (64, 128) for p, parts in (("dkdv", ", true"), ("dq_sum", ""))] + [
        f"flash_{p}_sm90_kernel<{t}, {d}>" for p in ("bwd_dkdv", "bwd_dq")
        for t in ("__half", "__nv_bfloat16") for d in (64, 128)]
    for row in rows:   # (the partials' sum: plain loads and stores)
        assert row.ok and ("dq_sum" in row.kernel or all(
            row.sass[o] > 0 for o in ("HGMMA", "UTMALDG", "SYNCS"))), compile_gate.format_table([row])
    source = compiler.read_source("sm90_gemm.cu")
    for lines, missing in ((("sm90::wgmma_fence();", "sm90::wgmma_m64n128k16_ss<__half>(acc, da + 2 * kk, db + 2 * kk, 1);",
                             "sm90::wgmma_commit();", "sm90::wgmma_wait<0>();"), "NO HGMMA"),
                           (("sm90::tma_load_2d(stage[s].a, map_a, t * kBlockK, m0, &full[s]);",
                             "sm90::tma_load_2d(stage[s].b, map_b, t * kBlockK, n0, &full[s]);"), "NO UTMALDG")):
        text = source
        for line in lines:
            assert line in text
            text = text.replace(line, "")
        [row] = compile_gate.run_gate(archs=["sm_90a"], sass=True, use_cache=False, sources={"sm90_gemm.cu": text},
                                      only=("sm90_gemm.cu",))
        assert not row.ok and row.status == missing, row.status
    # the same rule for a templated kernel (REQUIRED_SASS names the template)
    text = compiler.read_source("flash_fwd_sm90.cu")
    for line, by in (("wgmma_s<T, BN>(sc, ", "(void)(sc, "),
                     ("wgmma_pv<T, HEAD_DIM>(acc, pa[kk],", "(void)(pa[kk],"),
                     ("wgmma_pv<T, HEAD_DIM>(acc, pa_lo[kk],", "(void)(pa_lo[kk],"),
                     ("sm90::wgmma_fence();", ""), ("sm90::wgmma_commit();", ""),
                     ("sm90::wgmma_wait<0>();", "")):
        assert line in text
        text = text.replace(line, by)
    rows = compile_gate.run_gate(archs=["sm_90a"], sass=True, use_cache=False,
                                 sources={"flash_fwd_sm90.cu": text}, only=("flash_fwd_sm90.cu",))
    assert [r.status for r in rows] == ["NO HGMMA"] * len(tiling.all_sm90_fwd_plans())


def test_cupy_arch_option_keeps_the_specific_target():
    """CuPy's RawModule appends its own -arch=sm_90 (its _get_arch_for_options_for_nvrtc, called
    here as CuPy calls it on an H100) after the caller's options; the run-time options add
    -arch=sm_90a, and NVRTC compiles for sm_90a: the PTX targets it and wgmma assembles."""
    from cupy.cuda import compiler as cupy_compiler
    from cupy.cuda import nvrtc
    cupy_arch, method = cupy_compiler._get_arch_for_options_for_nvrtc.__wrapped__("90")
    assert (cupy_arch, method) == ("-arch=sm_90", "cubin")
    options = compiler.nvrtc_options() + compiler.arch_specific_options((9, 0)) + \
        compile_gate.CUPY_APPENDED_OPTIONS + (cupy_arch,)
    prog = nvrtc.createProgram(compiler.read_source("sm90_gemm.cu"), "sm90_gemm.cu", (), ())
    try:
        nvrtc.compileProgram(prog, options)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    assert compiler.arch_specific_options((8, 0)) == () and compiler.arch_specific_options((10, 0)) == ()
