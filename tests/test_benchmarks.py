"""The GPU benchmark without a GPU: its --dry-run end to end, and its sweep, validation,
ratios and CSV driven by NumPy implementations on a simulated clock."""
import csv
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import cuflash
from conftest import HAS_GXX
from cuflash.flops import attention_flops

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"
BENCH_CPU = BENCH.parent / "bench_cpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not HAS_GXX, reason="the dry run validates in the emulator, which needs g++")
def test_bench_gpu_dry_run(bench, tmp_path, capsys):
    rc = bench.main(["--dry-run", "--dtype", "float16", "float32", "--d", "64",
                     "--seqlens", "512", "--causal", "true", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no GPU timings exist yet" in out and "FAILED" not in out
    peers = out.split("peers a GPU run would compare against:")[1]
    for peer in ("torch-flash", "torch-cudnn", "torch-efficient", "jax-cudnn", "flash-attn"):
        assert f"  {peer} " in peers
    rows = list(csv.DictReader(open(tmp_path / "bench_gpu_plans.csv")))
    by = {(r["dtype"], r["arch"]): r for r in rows}
    assert by[("float16", "sm_80")]["kernel"].startswith("flash_fwd_tc_kernel<__half, 64")
    assert by[("float16", "sm_70")]["path"].startswith("SIMT")
    assert not (tmp_path / "bench_gpu.csv").exists()  # nothing timed


@pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
def test_cuflash_two_kernel_peer_runs_the_seven_gemm_backward(bench, monkeypatch):
    # cuflash-2kernel's passes on the emulator standing in for the GPU: its backward is the
    # two-kernel one (the dQ kernel launched, no dQ partials) and matches the reference,
    # and cuflash's own backward of the same inputs is the 5-GEMM one
    from conftest import assert_close_to_reference, emulator_backend, plain_backward
    from cuflash import reference
    from cuflash.backends import kernels
    be = emulator_backend("sm_80")
    monkeypatch.setattr(kernels, "cuda_backend", lambda: be)
    real = cuflash.flash_attention
    monkeypatch.setattr(cuflash, "flash_attention",
                        lambda *a, **kw: real(*a, **{**kw, "backend": "emulator"}))
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 2, 70, 64)).astype(np.float16) for _ in range(4))
    impl = bench.make_impls(["cuflash-2kernel"])[1]
    assert impl.name == "cuflash-2kernel" and "flash_bwd_dq_tc" in impl.describe(q, k, v, do)
    be.take_launches()
    dq, dk, dv = impl.passes(q, k, v, do, True, 0.125)["bwd"]()
    assert [p.kernel for p in be.take_launches()][1:] == ["flash_bwd_dkdv_tc", "flash_bwd_dq_tc"]
    o, lse = real(q, k, v, causal=True, scale=0.125, return_lse=True, backend="numpy")
    args = (do, q, k, v, o, lse)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv),
                             reference.attention_backward(*args, causal=True, scale=0.125),
                             plain_backward(*args, causal=True, scale=0.125, dtype=q.dtype)):
        assert_close_to_reference(g, r, p, q.dtype, factor=3.0, what=name)
    assert "flash_bwd_dq_sum" in bench.make_impls([])[0].describe(q, k, v, do)


class Clock:
    """Simulated seconds: each measurement costs `step`."""

    def __init__(self, step=10.0):
        self.t, self.step = 0.0, step

    def __call__(self):
        return self.t


def numpy_impl(bench, name, tflops, clock, *, dtypes=("float16", "float32"), corrupt=None,
               corrupt_dq=None, missing=None):
    """An implementation on cuflash's NumPy backend whose 'GPU' runs at `tflops`; `corrupt`
    spoils the forward's output, `corrupt_dq` the gradient dq, `missing` makes it
    unavailable."""

    class NumpyImpl(bench.Impl):
        timer = "simulated"

        def missing(self):
            return missing

        def from_host(self, arrays):
            return [np.asarray(a) for a in arrays]

        def random(self, shape, dtype_name):
            return np.random.default_rng(1).standard_normal(shape).astype(bench._dtype(dtype_name))

        def to_host(self, x):
            return np.asarray(x, np.float64)

        def passes(self, q, k, v, do, causal, scale):
            kw = dict(causal=causal, scale=scale, backend="numpy")
            o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)

            def fwd():
                return corrupt(o) if corrupt else o

            def bwd():
                return cuflash.flash_attention_backward(do, q, k, v, o, lse, **kw)

            def fwd_bwd():
                dq, dk, dv = bwd()
                return o, (corrupt_dq(dq) if corrupt_dq else dq, dk, dv)
            self.problem = (q.shape, causal)
            self.mode_of = {id(fwd): "fwd", id(bwd): "bwd", id(fwd_bwd): "fwd+bwd"}
            return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}

        def time(self, fn, n_repeat, max_s):
            (B, H, N, d), causal = self.problem
            clock.t += clock.step
            flops = attention_flops(B, H, N, N, d, causal=causal, pass_=self.mode_of[id(fn)])
            return flops / (tflops * 1e12)

    impl = NumpyImpl()
    impl.name, impl.dtypes = name, dtypes
    return impl


def test_sweep_runs_sizes_in_order_and_stops_at_the_budget(bench):
    clock = Clock(step=10.0)
    impls = [numpy_impl(bench, "cuflash", 100.0, clock),
             numpy_impl(bench, "torch-flash", 50.0, clock, dtypes=("float16",)),
             numpy_impl(bench, "jax-cudnn", 1.0, clock, missing="JAX is not installed")]
    args = bench.parse_args(["--dtype", "float16", "float32", "--d", "16", "--seqlens", "256",
                             "64", "128", "--causal", "false", "--tokens", "256", "--heads", "1"])
    configs = bench.sweep(args)
    assert [c[3] for c in configs] == [64, 64, 128, 128, 256, 256]   # ascending N
    assert [c[4] for c in configs[::2]] == [4, 2, 1]                 # B = tokens / N
    # 10 s per measurement: N = 64 takes 90 s (float16: 3 + 3, float32: 3, as torch-flash
    # refuses float32), N = 128 as much; N = 256 would start after the 160 s budget.
    rows = bench.run_sweep(impls, configs, heads=1, n_repeat=3, max_s=1.0, budget=160.0,
                           clock=clock, log=lambda *a: None)
    assert len(rows) == 6 * 3 * 3          # every (configuration, implementation, pass)
    status = {(r["impl"], r["dtype"], r["N"], r["mode"]): r["status"] for r in rows}
    assert status[("cuflash", "float16", 128, "bwd")] == "ok"
    assert status[("cuflash", "float32", 128, "fwd")] == "ok"
    assert {status[("cuflash", dt, 256, m)] for dt in ("float16", "float32")
            for m in bench.MODES} == {"budget"}
    assert status[("torch-flash", "float32", 64, "fwd")] == "unsupported"
    assert status[("jax-cudnn", "float16", 64, "fwd")] == "unavailable"
    ok = {(r["impl"], r["dtype"], r["N"], r["mode"]): r for r in rows if r["status"] == "ok"}
    # the rate the simulated device was given, through FLOPs / time
    assert ok[("cuflash", "float16", 64, "fwd+bwd")]["tflops"] == pytest.approx(100.0)
    assert ok[("torch-flash", "float16", 128, "bwd")]["tflops"] == pytest.approx(50.0)
    assert ok[("cuflash", "float16", 64, "fwd")]["ms"] == pytest.approx(
        4 * 4 * 1 * 64 * 64 * 16 / 100e12 * 1e3)


def test_validation_says_why_an_implementation_is_not_timed(bench):
    clock = Clock()
    good = numpy_impl(bench, "cuflash", 1.0, clock)
    assert bench.validate(good, "float16", 16, True)[0] == "ok"
    for spoil in ({"corrupt": lambda o: o * np.nan}, {"corrupt_dq": lambda dq: dq * np.nan}):
        nan = numpy_impl(bench, "peer", 1.0, clock, **spoil)
        status, note = bench.validate(nan, "float16", 16, False)
        assert status == "invalid" and "nan" in note, spoil   # NaN never passes a tolerance
    off = numpy_impl(bench, "peer", 1.0, clock, corrupt=lambda o: o + np.float16(0.05))
    assert bench.validate(off, "float16", 16, False)[0] == "invalid"

    def refuse(error):
        impl = numpy_impl(bench, "peer", 1.0, clock)
        impl.passes = lambda *a: (_ for _ in ()).throw(error)
        return bench.validate(impl, "float16", 16, False)
    assert refuse(RuntimeError("No available kernel. Aborting execution."))[0] == "unsupported"
    assert refuse(NotImplementedError("head dim 256"))[0] == "unsupported"
    status, note = refuse(MemoryError("out of memory"))
    assert status == "error" and "MemoryError: out of memory" in note


def test_ratios_and_the_csv_round_trip(bench, tmp_path):
    clock = Clock()
    impls = [numpy_impl(bench, "cuflash", 120.0, clock),
             numpy_impl(bench, "torch-cudnn", 80.0, clock),
             numpy_impl(bench, "torch-efficient", 40.0, clock)]
    rows = bench.run_sweep(impls, [("float16", True, 16, 64, 2)], heads=1, n_repeat=3,
                           max_s=1.0, clock=clock, log=lambda *a: None)
    table = bench.ratios(rows)
    assert table[("float16", True, 16, 64, "fwd")] == pytest.approx(
        {"torch-cudnn": 1.5, "torch-efficient": 3.0})
    path = tmp_path / "bench_gpu.csv"
    bench.write_csv(rows, path)
    back = bench.read_csv(path)
    assert [(r["impl"], r["causal"], r["N"], r["status"]) for r in back] == \
        [(r["impl"], r["causal"], r["N"], r["status"]) for r in rows]
    again = bench.ratios(back)
    assert again.keys() == table.keys()
    for key, got in table.items():
        assert again[key] == pytest.approx(got)
    cells = [r for r in csv.DictReader(open(path)) if r["impl"] == "cuflash"]
    assert [float(r["vs_torch-efficient"]) for r in cells] == pytest.approx([3.0] * 3)


@pytest.mark.parametrize("argv, named", [(["--d", "0"], "--d"), (["--seqlens", "x"], "--seqlens"),
                                         (["--budget", "-5"], "--budget"),
                                         (["--peers", "torch"], "--peers")])
def test_bad_arguments_are_named(bench, capsys, argv, named):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert named in err and repr(argv[1]).strip("'") in err


@pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
def test_cuflash_sm90_peer_runs_the_hopper_kernels(bench, monkeypatch):
    # cuflash-sm90 on the emulator's sm_90a standing in for an H100: its forward is
    # flash_fwd_sm90.cu's on a persistent grid and its backward flash_bwd_sm90.cu's, each
    # matching the reference; it says what it does not take, and
    # that it needs an sm_90 GPU on any other
    from conftest import assert_close_to_reference, plain_attention, plain_backward
    from cuflash import reference
    from cuflash.backends import kernels
    impl = bench.make_impls(["cuflash-sm90"])[1]
    assert impl.unsupported("float32", 64) and impl.unsupported("float16", 96)
    assert impl.unsupported("float16", 128) is None and impl.unsupported("bfloat16", 64) is None
    monkeypatch.setattr(kernels, "cuda_backend", lambda: kernels.emulator_backend(arch="sm_80"))
    monkeypatch.setattr(bench._CupyImpl, "missing", lambda self: None)
    assert "sm_90" in impl.missing()
    be = kernels.emulator_backend(arch="sm_90a")
    monkeypatch.setattr(kernels, "cuda_backend", lambda: be)
    assert impl.missing() is None
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 2, 150, 64)).astype(np.float16) for _ in range(4))
    assert impl.describe(q, k, v, do) == ("flash_fwd_sm90_kernel<__half, 64, false> (persistent); "
                                          "flash_bwd_dkdv_sm90_kernel<__half, 64>; "
                                          "flash_bwd_dq_sm90_kernel<__half, 64>")
    passes = impl.passes(q, k, v, do, True, 0.125)
    o = passes["fwd"]()
    ref = reference.naive_attention(q, k, v, causal=True, scale=0.125, return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=True, scale=0.125, dtype=q.dtype)
    assert_close_to_reference(o, ref[0], plain, q.dtype, what="o")
    grads = passes["bwd"]()
    o, lse = (x.astype(np.float32) for x in ref)
    ref = reference.attention_backward(do, q, k, v, o.astype(q.dtype), lse, causal=True, scale=0.125)
    plain = plain_backward(do, q, k, v, o.astype(q.dtype), lse, causal=True, scale=0.125,
                           dtype=q.dtype)
    for name, out, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert_close_to_reference(out, r, p, q.dtype, factor=3.0, what=name)


def test_bench_cpu_names_its_files_and_machine(tmp_path):
    """A tiny bench_cpu run as the README runs it (without PyTorch): the tagged CSV and plot,
    and the header and every timed row naming the CPU, the BLAS kernels it ran on and the
    speed of this process's exponentials."""
    proc = subprocess.run([sys.executable, str(BENCH_CPU), "--quick", "--no-torch", "--sweep", "64",
                           "--seqlen", "64", "--out", str(tmp_path), "--tag", "x"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_cpu_x.csv", "bench_cpu_x.png"]
    rows = [r for r in csv.DictReader(open(tmp_path / "bench_cpu_x.csv"))
            if r["impl"] == "cuflash" and r["pass"] in ("fwd", "bwd")]
    assert len(rows) == 4 and all(r["cpu"] and r["simd"] and r["blas"] for r in rows)
    assert all(re.fullmatch(r"exp2 \d+\.\d\d ns, exp \d+\.\d\d ns", r["exp"]) for r in rows)
    header = proc.stdout.splitlines()[0]
    assert header.startswith("# cuflash CPU benchmark — ") and f" with {rows[0]['blas']}" in header
    assert f"({rows[0]['exp']} per float32)" in header
    # which forward ran: the compiled kernel, timed beside the NumPy tiles, or the tiles
    from cuflash.backends.numpy_backend import native
    said = proc.stdout.splitlines()[1]
    tiles = [r for r in csv.DictReader(open(tmp_path / "bench_cpu_x.csv")) if r["impl"] == "tiles"]
    if native.library()[0] is not None:
        assert said.startswith(f"forward and backward: the compiled kernels "
                               f"({native.best_isa()} build)")
        assert sorted((r["pass"], r["causal"]) for r in tiles) == [
            (p, c) for p in ("bwd", "fwd", "fwd+bwd") for c in ("False", "True")]
    else:
        assert said.startswith("forward and backward: the NumPy tiles (") and not tiles


def test_machine_names_capped_instruction_sets(monkeypatch):
    """A run whose instruction sets are capped below the CPU's says so in its SIMD column."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from machine import machine
    finally:
        sys.path.remove(str(BENCH.parent))
    for var in ("NPY_DISABLE_CPU_FEATURES", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)
    assert "capped" not in machine()["simd"]
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "X86_V4")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine()["simd"].endswith(
        "(capped: NPY_DISABLE_CPU_FEATURES=X86_V4, ATEN_CPU_CAPABILITY=avx2)")
