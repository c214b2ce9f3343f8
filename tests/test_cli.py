"""The command line: what `info` reports about this machine, and what `bench` measures
and writes."""
import csv
import dataclasses
import re
import subprocess
import sys
import types

import pytest

import cuflash.emulator
from cuflash import cli
from cuflash.backends import numpy_backend as nb
from cuflash.backends.numpy_backend.expbase import BASE_2, BASE_E
from cuflash.emulator import archs
from test_compile_gate import WITHOUT_ML_DTYPES


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli, "_gpu", lambda: (None, "CuPy sees no CUDA device"))


def test_info_names_the_cpu_backends_exponential(capsys, monkeypatch):
    for base, workers in ((BASE_2, 3), (BASE_E, 5)):
        config = dataclasses.replace(nb.BACKEND.config, base=base, workers=workers)
        monkeypatch.setattr(nb, "BACKEND", nb.NumpyBackend(config))
        assert cli.main(["info"]) == 0
        out = capsys.readouterr().out
        numpy_line = next(line for line in out.splitlines() if line.strip().startswith("numpy"))
        assert f"exponentials in base {base.name}:" in numpy_line
        assert f"{workers} workers" in numpy_line


def test_info_says_which_cpu_kernels_run(capsys, monkeypatch):
    """The compiled kernels' build where it loads, else why the NumPy tiles run."""
    from cuflash.backends.numpy_backend import native
    monkeypatch.setattr(native, "best_isa", lambda: "avx2")
    for found, want in ((("a library", None), "float32: the compiled avx2 kernels)"),
                        ((None, "no C++ compiler"), "float32: the NumPy tiles, as no C++ compiler)")):
        monkeypatch.setattr(native, "library", lambda isa, found=found: found)
        assert cli.main(["info"]) == 0
        numpy_line = next(line for line in capsys.readouterr().out.splitlines()
                          if line.strip().startswith("numpy"))
        assert numpy_line.endswith(want), numpy_line


def test_info_is_short_without_a_gpu(capsys, no_gpu):
    """By default: the versions, the dtypes, one line per backend and how to see plans."""
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 8, "\n".join(lines)
    assert "--arch sm_XY" in lines[-1] and "--verbose" in lines[-1]


def test_info_tells_whether_the_emulator_can_build(capsys, monkeypatch):
    """g++ alone is not enough: the emulator's own verdict is what info prints."""
    reason = "the CUDA emulator needs crt/host_defines.h (pip install nvidia-cuda-nvcc-cu12)"
    monkeypatch.setattr(cuflash.emulator, "availability", lambda: (False, reason),
                        raising=False)
    assert cli.main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("emulator"))
    assert line.split(None, 1)[1] == f"unavailable: {reason}"


def test_info_lists_each_archs_plans_with_occupancy(capsys, monkeypatch, no_gpu):
    """--verbose shows what every arch would run and why, with the occupancy from the
    gate's registers (here 128 for every kernel)."""
    from cuflash import compile_gate, tiling
    names = [*tiling.every_plan(), *(p.name_expression for p in (*tiling.all_sm90_fwd_plans(),
                                                                  *tiling.all_sm90_bwd_plans()))]
    monkeypatch.setattr(compile_gate, "cached_registers", lambda arch: dict.fromkeys(names, 128))
    assert cli.main(["info", "--verbose"]) == 0
    out = capsys.readouterr().out
    sm80 = out[out.index("plans on sm_80 (A100"):out.index("plans on sm_86")]
    first = sm80.splitlines()[1:3]
    # 128 threads × 128 registers = 16384 of 65536: 4 blocks; the tile's 48 KB + 1 KB
    # reserve fits 3× in 164 KB
    assert "flash_fwd_tc_kernel<__half, 64, 128, 64, 4, 2, false>" in first[0]
    assert "3 blocks, 12 warps per SM" in first[0]
    assert "tensor cores" in first[1]
    sm70 = out[out.index("plans on sm_70 (Tesla V100"):out.index("plans on sm_75")]
    assert "SIMT: float16 tensor cores need sm_75" in sm70
    # an H100 runs the Hopper forward and backward for plain calls (384 threads × 128
    # registers: 1 block of 160 KB), mma.sync for the rest
    sm90 = out[out.index("plans on sm_90 (H100"):out.index("plans on sm_100")].splitlines()
    i = next(i for i, x in enumerate(sm90) if "float16   d=128  forward" in x)
    assert "flash_fwd_sm90_kernel<__half, 128, false>" in sm90[i] and "1 block, 12 warps" in sm90[i]
    assert "wgmma on sm_90a" in sm90[i + 1]
    assert "flash_bwd_dkdv_sm90_kernel<__half, 128>" in sm90[i + 2] and "1 block" in sm90[i + 2]
    assert "flash_bwd_dq_sm90_kernel<__half, 128>" in sm90[i + 3]
    assert "?" not in out and "check-kernels" not in out


def test_info_says_once_how_to_get_registers(capsys, monkeypatch, no_gpu):
    from cuflash import compile_gate
    monkeypatch.setattr(compile_gate, "cached_registers", lambda arch: {})
    assert cli.main(["info", "--arch", "sm_80", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "plans on sm_80" in out and "plans on sm_90" in out and "plans on sm_75" not in out
    assert "?" not in out and "warps per SM" not in out
    hints = [x for x in out.splitlines() if "check-kernels" in x]
    assert len(hints) == 1 and "check-kernels --arch sm_80 --arch sm_90 --arch sm_90a" in hints[0]


def test_info_lists_the_local_gpus_plans(capsys, monkeypatch):
    """With a GPU, info lists its plans by default, from the device's own limits (an H100
    PCIe's attributes, as cudaDeviceGetAttribute reports them)."""
    from cuflash import compile_gate
    monkeypatch.setattr(compile_gate, "cached_registers", lambda arch: {})
    attributes = {"MultiProcessorCount": 114, "MaxThreadsPerMultiProcessor": 2048,
                  "MaxBlocksPerMultiprocessor": 32, "MaxRegistersPerMultiprocessor": 65536,
                  "MaxSharedMemoryPerBlock": 49152, "MaxSharedMemoryPerBlockOptin": 232448,
                  "MaxSharedMemoryPerMultiprocessor": 233472,
                  "ReservedSharedMemoryPerBlock": 1024}
    dev = types.SimpleNamespace(id=0, compute_capability="90", attributes=attributes)
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda i: {"name": b"NVIDIA H100 PCIe"},
        memGetInfo=lambda: (70 * 2**30, 80 * 2**30))
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(cli, "_gpu", lambda: (cupy, dev))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cuda      NVIDIA H100 PCIe, compute capability 90, 70.0 of 80.0 GiB free" in out
    assert "plans on sm_90 (NVIDIA H100 PCIe: 114 SMs, 227 KiB shared memory per block)" in out
    assert "tensor cores: mma.m16n8k16 on sm_90" in out
    assert "114 SMs: " in out  # the split-KV example counts this GPU's SMs
    assert out.count("plans on ") == 1


def test_info_without_ml_dtypes_lists_the_bfloat16_kernels():
    """The bfloat16 kernels exist whether or not ml_dtypes (NumPy's bfloat16) is here."""
    code = WITHOUT_ML_DTYPES + ("from cuflash import cli\n"
                                'sys.exit(cli.main(["info", "--arch", "sm_80"]))')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "bfloat16 needs ml_dtypes" in proc.stdout
    bf16 = proc.stdout[proc.stdout.index("bfloat16  d=64"):proc.stdout.index("float32   d=64")]
    assert "flash_fwd_tc_kernel<__nv_bfloat16, 64," in bf16
    assert "tensor cores: mma.m16n8k16 on sm_80" in bf16


def test_info_rejects_an_unknown_arch(capsys, no_gpu):
    with pytest.raises(SystemExit):
        cli.main(["info", "--arch", "sm_99"])
    err = capsys.readouterr().err
    assert "'sm_99'" in err and "sm_80" in err


def test_info_lists_a_blackwell_consumer_gpus_plans(capsys, monkeypatch, no_gpu):
    """sm_120 (RTX 5090: 170 SMs, 99 KB of shared memory per block, 100 KB per SM, 1536
    threads per SM) runs the sm_80 mma.sync plans within its 99 KB."""
    kib = 1024
    rtx5090 = archs.Arch("sm_120", 1200, archs.GpuLimits("RTX 5090", 170, 1536, 32, 65536, 255,
                                                         48 * kib, 99 * kib, 100 * kib, kib),
                         archs.ARCHS["sm_90"].mma)
    monkeypatch.setitem(archs.ARCHS, "sm_120", rtx5090)
    assert cli.main(["info", "--arch", "sm_120"]) == 0
    out = capsys.readouterr().out
    assert "plans on sm_120 (RTX 5090: 170 SMs, 99 KiB shared memory per block)" in out
    f16 = out[out.index("float16   d=128"):out.index("float16   d=256")]
    assert "flash_fwd_tc_kernel<__half, 128," in f16
    assert "tensor cores: mma.m16n8k16 on sm_120" in f16
    # the default backward: two kernels (a 5-GEMM tile costs as much: DQ_PARTS_TILE_COST)
    assert "flash_bwd_dkdv_tc_kernel<__half, 128," in f16 and "5 GEMMs" not in f16
    assert "flash_bwd_dq_tc_kernel<__half, 128," in f16


# -- bench --------------------------------------------------------------------------------

def _fake_clock(step):
    """A perf_counter that advances `step` seconds at every call."""
    t = [0.0]

    def perf_counter():
        t[0] += step
        return t[0]
    return types.SimpleNamespace(perf_counter=perf_counter)


def test_bench_writes_a_table_csv_and_plot_with_slow_rates(tmp_path, capsys, monkeypatch):
    """Every call takes 10 s by the fake clock: GFLOP/s are tiny and must stay nonzero."""
    monkeypatch.setattr(cli, "time", _fake_clock(10.0))
    assert cli.main(["bench", "--backend", "numpy", "--n", "32", "64", "--heads", "2",
                     "--d", "16", "--repeat", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "bench_numpy_float32.csv")))
    assert len(rows) == 2 * 2 * 2  # N × causal × pass
    for r in rows:
        n, causal = int(r["n"]), r["causal"] == "True"
        # FlashAttention's count by hand: two N×N×d matmuls of 2 FLOPs per multiply-add
        # per head, halved when causal; the backward's five matmuls count 2.5×
        flops = 2 * 2 * (2 * n * n * 16) / (2 if causal else 1)
        flops *= 2.5 if r["pass"] == "bwd" else 1
        assert float(r["ms_median"]) == pytest.approx(10_000)
        assert float(r["gflops"]) == pytest.approx(flops / 10 / 1e9)
        assert float(r["max_rel_err"]) < 1e-4
    # N=32 non-causal forward: 2·2·2·32·32·16 = 131072 FLOPs in 10 s = 1.31e-5 GFLOP/s
    line = next(x for x in out.splitlines() if re.match(r"\s+32\s+False", x))
    assert line.split()[2:5] == ["10000", "0.0000131", "10000"]
    assert pytest.importorskip("matplotlib")
    assert (tmp_path / "bench_numpy_float32.png").stat().st_size > 0


def test_bench_help_gives_every_options_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text[text.index("options:"):])[1:]
    assert len(options) >= 8
    for option in options:
        if not option.startswith("-h"):
            assert "default:" in " ".join(option.split()), option


def test_bench_default_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.bench_out_dir() == tmp_path
    (tmp_path / "benchmarks").mkdir()
    assert cli.bench_out_dir() == tmp_path / "benchmarks" / "results"


@pytest.mark.parametrize("x, text", [(0.0001048576, "0.000105"), (312456.7, "312457"),
                                     (15.36, "15.4"), (1.0, "1.00"), (0.0, "0")])
def test_significant(x, text):
    assert cli.significant(x) == text
