"""The compile gate: every specialization compiles with NVRTC for every gate arch and
assembles with ptxas without spilling — and the gate itself can fail.

The full run is cached on disk (keyed by source + headers + options + names + NVRTC
version), so only the first run after a kernel edit pays the cold compile.
"""
import pytest

from cuflash import compile_gate, compiler, tiling


def _have_toolchain():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        compile_gate.ptxas_path()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _have_toolchain(), reason="NVRTC or ptxas not installed")


@pytest.fixture(scope="module")
def gate_rows():
    # with the disassembly where nvdisasm is installed, as `check-kernels` runs it: the
    # kernel tests' SASS checks then find these builds in the cache
    return compile_gate.run_gate(sass=compile_gate.nvdisasm_path() is not None)


def test_every_specialization_compiles_without_spills(gate_rows):
    bad = [r for r in gate_rows if not r.ok]
    assert not bad, "\n" + compile_gate.format_table(bad) + "\n" + (bad[0].error or "")


def test_gate_covers_every_arch_and_backward_kernel(gate_rows):
    seen = {(r.kernel, r.arch) for r in gate_rows}
    for name in tiling.specializations()["flash_bwd.cu"]:
        for arch in compiler.GATE_ARCHS:
            assert (name, arch) in seen


def test_backward_smem_formula_matches_ptxas(gate_rows):
    """The Python plan's shared-memory bytes are what ptxas reports for the kernel."""
    by_name = {(r.kernel, r.arch): r for r in gate_rows}
    for p in tiling.all_bwd_plans():
        for arch in compiler.GATE_ARCHS:
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
    assert info == {"_Z3fooPf": {"registers": 255, "smem": 16384,
                                 "spill_stores": 4, "spill_loads": 12}}


# -- architectures the installed NVRTC cannot target --------------------------------------

def test_split_archs_names_what_it_skips_and_why():
    build, skipped = compile_gate.split_archs(("sm_70", "sm_75", "sm_80"),
                                              ("sm_75", "sm_80", "sm_90"), (13, 0))
    assert build == ("sm_75", "sm_80")
    assert list(skipped) == ["sm_70"]
    assert "NVRTC 13.0 cannot target sm_70" in skipped["sm_70"]


def test_check_kernels_builds_what_it_can_and_lists_the_rest(capsys, monkeypatch):
    """A toolkit without sm_70 (CUDA 13): the gate passes on the archs it can build."""
    monkeypatch.setattr(compile_gate, "nvrtc_archs", lambda: ("sm_75", "sm_80"))
    monkeypatch.setattr(compile_gate, "collect_specializations",
                        lambda: {"planted.cu": ["light<2>"]})
    monkeypatch.setattr(compiler, "read_source", lambda name: PLANTED)
    assert compile_gate.check_kernels(["--arch", "sm_70", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "light<2>" in out and "1 builds" in out
    assert "skipped sm_70: NVRTC" in out
    # Nothing buildable is a failure, not a silent pass.
    assert compile_gate.check_kernels(["--arch", "sm_70"]) == 1


# -- the forward's shared-memory formula, through ptxas ------------------------------------

SMEM_PROBE = r"""
#include "attn_tile.cuh"
// The forward's shared memory is dynamic, so ptxas cannot see it in the kernel itself:
// this probe declares a quarter of AttnTileTraits::kSmemBytes statically (the whole would
// exceed the 48 KB limit of static shared memory), which ptxas reports.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
__global__ void smem_probe(unsigned char* out) {
    constexpr int kBytes = cuflash::AttnTileTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                   NUM_WARPS>::kSmemBytes;
    static_assert(kBytes % 4 == 0, "the accumulators are 4 or 8 bytes");
    __shared__ unsigned char s[kBytes / 4];
    s[threadIdx.x] = (unsigned char)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[sizeof(s) - 1 - threadIdx.x];
}
"""


def test_forward_smem_formula_matches_ptxas():
    """tiling.attention_smem_bytes is what the kernel's traits (kSmemBytes) declare."""
    plans = {p.name_expression: p for p in tiling.all_plans()}
    probes = {name.replace(name[:name.index("<")], "smem_probe", 1): p
              for name, p in plans.items()}
    rows = compile_gate.run_gate({"smem_probe.cu": list(probes)}, archs=["sm_80"],
                                 sources={"smem_probe.cu": SMEM_PROBE})
    for r in rows:
        assert r.ok, r.error
        assert 4 * r.smem == probes[r.kernel].smem_bytes, str(probes[r.kernel])
