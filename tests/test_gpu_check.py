"""tools/gpu_check.py and tools/sanitize_gpu.sh without a GPU: the dry run end to end, the
parsers of pytest's and the sanitizer's output, and the summary a GPU run writes (its
sections' commands replaced by canned output)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from conftest import HAS_GXX

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not HAS_GXX, reason="the dry run validates in the emulator, which needs g++")
def test_dry_run_plans_every_section_from_a_plain_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(TOOL), "--dry-run", "--dtype", "float16",
                           "--d", "64", "--seqlens", "1024", "--causal", "false",
                           "--out", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # the three sections, in their order, each with its plan
    starts = [out.index(f"[{name}] would run") for name in ("tests", "sanitize", "bench", "workers",
                                                             "capture")]
    assert starts == sorted(starts)
    summary = out.split("gpu_check --dry-run summary:")[1]
    n_tests = int(summary.split("tests     ok: ")[1].split()[0])
    assert n_tests > 0
    assert "sanitize  ok: " in summary and "memcheck, synccheck, racecheck" in summary
    assert "bench     ok: plan written, cuflash validated in the emulator" in summary
    assert "workers   ok: 6 shapes planned (five GEMMs against two kernels)" in summary
    assert "  B=1 H=16 N=16384 d=128: 128 key blocks of 128, W = 0 8 9" in out
    assert "capture   ok: 6 captures (mma.sync and wgmma, fp16/bf16/tf32) recorded in the emulator" in summary
    for check in ("memcheck", "racecheck", "synccheck"):
        assert f"would run: compute-sanitizer --tool {check}" in out
    peers = out.split("peers a GPU run would compare against:")[1]
    for peer in ("torch-flash", "torch-cudnn", "torch-efficient", "jax-cudnn", "flash-attn"):
        assert f"  {peer} " in peers
    assert "float16   causal=False max rel err" in out and "FAILED" not in out
    # nothing that claims a timing
    assert (tmp_path / "bench_gpu_plans.csv").exists()
    for name in ("bench_gpu.csv", "bench_gpu.png", "gpu_check.md", "gpu_check.json",
                 "bench_dq_workers.csv"):
        assert not (tmp_path / name).exists(), name


def test_pytest_output_counts_complete_and_stopped(gpu_check):
    complete = """\
tests/test_api.py::test_a[cuda] PASSED                                   [ 25%]
tests/test_api.py::test_b[cuda] FAILED                                   [ 50%]
tests/test_api.py::test_c[cuda] SKIPPED (no CUDA device)                 [ 75%]
tests/test_api.py::test_d[cuda] PASSED                                   [100%]
tests/test_api.py::test_d[cuda] ERROR                                    [100%]
=========================== short test summary info ============================
FAILED tests/test_api.py::test_b[cuda] - AssertionError: 0.5 > 0.02
ERROR tests/test_api.py::test_d[cuda] - RuntimeError: teardown
=== 1 failed, 2 passed, 1 skipped, 3 warnings, 1 error in 80.50s (0:01:20) ===
"""
    res = gpu_check.parse_pytest(complete)
    assert res["complete"]
    assert res["counts"] == dict(passed=2, failed=1, error=1, skipped=1, xfailed=0, xpassed=0)
    assert res["failures"] == ["tests/test_api.py::test_b[cuda]", "tests/test_api.py::test_d[cuda]"]
    stopped = """\
8 workers [151 items]
[gw0] [  1%] PASSED tests/test_api.py::test_a[cuda]
[gw1] [  2%] PASSED tests/test_api.py::test_e[cuda]
[gw2] [  3%] FAILED tests/test_serving.py::test_f[cuda-1]
[gw1] [  4%] SKIPPED tests/test_api.py::test_g[cuda]
gpu_check: stopped after 270 s (the section's cap)
"""
    res = gpu_check.parse_pytest(stopped)
    assert not res["complete"]
    assert res["counts"] == dict(passed=2, failed=1, error=0, skipped=1, xfailed=0, xpassed=0)
    assert res["failures"] == ["tests/test_serving.py::test_f[cuda-1]"]


def test_sanitizer_lines(gpu_check):
    text = """\
== compute-sanitizer --tool memcheck: pytest -m gpu -v
sanitize_gpu: memcheck: exit=0 errors=0 tests=[40 passed in 60.1s]
sanitize_gpu: racecheck: exit=99 errors=3 tests=[40 passed in 70.0s]
sanitize_gpu: synccheck: exit=124 errors=? tests=[12 passed so far, stopped]
"""
    assert gpu_check.parse_sanitize(text) == {
        "memcheck": {"exit": 0, "errors": 0, "tests": "40 passed in 60.1s"},
        "racecheck": {"exit": 99, "errors": 3, "tests": "40 passed in 70.0s"},
        "synccheck": {"exit": 124, "errors": None, "tests": "12 passed so far, stopped"}}


def test_a_sanitizer_stopped_at_its_cap_is_incomplete(gpu_check):
    """No error in what ran, one tool stopped: INCOMPLETE, not PASS and not FAIL; an error
    anywhere, or a tool that failed otherwise: FAIL."""
    def verdict(text, rc=1):
        return gpu_check.sanitize_markdown({"command": "sanitize_gpu.sh", "when": "now",
                                            "gpu": "H100", "budget": 90, "exit": rc,
                                            "ok": False, "skipped": None,
                                            "tools": gpu_check.parse_sanitize(text)})
    stopped = ("sanitize_gpu: memcheck: exit=0 errors=0 tests=[9 passed in 4s]\n"
               "sanitize_gpu: synccheck: exit=124 errors=? tests=[3 passed so far, stopped]\n")
    assert "**INCOMPLETE: no sanitizer error in what ran" in verdict(stopped)
    assert "**FAIL** (exit 1)" in verdict(SANITIZER_RUN)
    failed = stopped.replace("synccheck: exit=124 errors=?", "synccheck: exit=1 errors=0")
    assert "**FAIL** (exit 1)" in verdict(failed)


H100 = {"when": "2026-11-20T10:00:00", "host": "gpu-host", "python": "3.12.3", "cupy": "14.2.0",
        "torch": "2.11.0+cu130", "jax": "0.11.2", "jaxlib": "0.11.2", "flash_attn": None,
        "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "gpu_memory": "81559 MiB",
        "cuda_runtime": "13.0", "driver_cuda": "13.0", "nvrtc": "13.0", "gpu_count": 1,
        "cc": "9.0", "sms": 132, "torch_cuda": "13.0", "cudnn": 91002,
        "cuda_headers": "/site/nvidia/cu13/include", "cuda_headers_version": "13.0"}

PYTEST_RUN = """\
[gw0] [ 33%] PASSED tests/test_api.py::test_a[cuda]
[gw1] [ 66%] FAILED tests/test_api.py::test_b[cuda]
[gw0] [100%] PASSED tests/test_api.py::test_c[cuda]
=========================== 1 failed, 2 passed in 41.07s ===========================
"""
SANITIZER_RUN = """\
sanitize_gpu: memcheck: exit=0 errors=0 tests=[77 passed in 70.2s]
sanitize_gpu: racecheck: exit=99 errors=2 tests=[77 passed in 75.0s]
sanitize_gpu: synccheck: exit=124 errors=? tests=[30 passed so far, stopped]
"""


# bench_dq_workers.csv of one shape at two head dims: W = 0 is the two kernels
WORKER_ROWS = [dict(B=1, H=16, N=16384, d=64, dtype="float16", W=w, ms=ms, tflops=0.0, model=int(w == 0))
               for w, ms in ((0, 10.0), (8, 8.0), (9, 12.5))] + \
              [dict(B=1, H=16, N=16384, d=128, dtype="float16", W=w, ms=ms, tflops=0.0, model=int(w == 0))
               for w, ms in ((0, 20.0), (8, 25.0), (9, 22.0))]


def bench_rows():
    """cuflash at 120 TFLOP/s, torch-cudnn at 80 (ratio 1.5) and torch-efficient at 48
    (2.5) at N = 1024; JAX missing; N = 2048 left by the budget."""
    base = dict(device="NVIDIA H100 80GB HBM3", dtype="float16", causal=True, B=16, H=16,
                d=64, timer="t")
    rows = []
    for N in (1024, 2048):
        for impl, tf in (("cuflash", 120.0), ("torch-cudnn", 80.0), ("torch-efficient", 48.0),
                         ("jax-cudnn", None)):
            for mode in ("fwd", "bwd", "fwd+bwd"):
                if N == 2048:
                    status, note = "budget", "not timed: the 480 s budget was spent"
                elif tf is None:
                    status, note = "unavailable", "JAX is not installed"
                else:
                    status, note = "ok", ""
                ok = status == "ok"
                rows.append(dict(base, impl=impl, N=N, mode=mode, status=status,
                                 ms=1.0 if ok else float("nan"),
                                 tflops=tf if ok else float("nan"), mem_mib=1.0, note=note))
    return rows


def test_staged_gpu_runs_add_up_to_one_summary(gpu_check, monkeypatch, tmp_path):
    import bench_dq_workers, bench_gpu  # gpu_check put benchmarks/ on sys.path
    calls = []

    def run_logged(cmd, timeout, log):
        cmd = list(map(str, cmd))
        calls.append((cmd, timeout))
        if "tools/sanitize_gpu.sh" in cmd:
            return 1, SANITIZER_RUN, 230.0, False
        if "benchmarks/bench_gpu.py" in cmd:
            bench_gpu.write_csv(bench_rows(), pathlib.Path(cmd[cmd.index("--out") + 1]) / "bench_gpu.csv")
            return 0, "", 470.0, False
        if "benchmarks/bench_dq_workers.py" in cmd:
            bench_dq_workers.write_csv(WORKER_ROWS, pathlib.Path(cmd[cmd.index("--out") + 1])
                                       / "bench_dq_workers.csv")
            return 0, "", 40.0, False
        return 1, PYTEST_RUN, 41.0, False

    monkeypatch.setattr(gpu_check, "environment", lambda: dict(H100))
    monkeypatch.setattr(gpu_check, "run_logged", run_logged)
    out = ["--out", str(tmp_path)]

    assert gpu_check.main(["--only", "tests", "sanitize", *out]) == 1   # a test failed
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Not run yet: `python3 tools/gpu_check.py --only bench`" in md
    assert [c[0][1:4] for c in calls][0] == ["-m", "pytest", "-m"]   # tests first
    assert calls[0][1] == gpu_check.CAPS["tests"]
    assert calls[1][0][:4] == ["bash", "tools/sanitize_gpu.sh", "--budget", "200"]  # 210 − 10

    assert gpu_check.main(["--only", "bench", *out]) == 0
    bench_cmd = calls[2][0]
    assert bench_cmd[bench_cmd.index("--budget") + 1] == str(gpu_check.CAPS["bench"] - 60)
    state = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(state) == {"environment", "tests", "sanitize", "bench"}
    md = (tmp_path / "gpu_check.md").read_text()
    for text in ("# cuflash on NVIDIA H100 80GB HBM3", "580.159.04 (supports CUDA 13.0)",
                 "| CUDA runtime (CuPy's) | 13.0 |", "| CuPy | 14.2.0 |",
                 "2.11.0+cu130 (CUDA 13.0, cuDNN 91002)", "0.11.2 (jaxlib 0.11.2)",
                 "| flash-attn | not installed |",
                 # tests and sanitizer, from the stage before
                 "**FAIL**: 2 passed, 1 failed in 41 s", "- `tests/test_api.py::test_b[cuda]`",
                 "| memcheck | 0 | 77 passed in 70.2s | 0 |",
                 "| racecheck | 2 | 77 passed in 75.0s | 99 (sanitizer errors) |",
                 "| synccheck | ? (stopped before its summary) | 30 passed so far, stopped "
                 "| 124 (stopped at the cap) |",
                 # cuflash's rate and its ratio to each peer, by hand: 120/80, 120/48
                 "| float16 | yes | 64 | 1024 | fwd | 120.0 | 1.50× | 2.50× | n/a |",
                 "| float16 | yes | 64 | 2048 | bwd | — | — | — | — |",
                 "| fwd | 1.50× (1) | 2.50× (1) | — |",
                 "configuration(s) from N = 2048 on were not timed",
                 "`bench_gpu.py --seqlens 2048` times them alone",
                 "jax-cudnn: unavailable: JAX is not installed (3)"):
        assert text in md, text
    assert (tmp_path / "bench_gpu.png").stat().st_size > 0

    assert gpu_check.main(["--only", "workers", *out]) == 0
    assert calls[3][0][1:] == ["benchmarks/bench_dq_workers.py", "--counts", "model", "--out",
                               str(tmp_path)]
    assert calls[3][1] == gpu_check.CAPS["workers"]
    md = (tmp_path / "gpu_check.md").read_text()
    # the fastest count per d against W = 0, by hand: 8 / 10 and 22 / 20; their geometric
    # mean √(0.8 · 1.1) = 0.938
    for text in ("| float16 | 1 × 16 × 16384 | 64 | 10.000 | 8.000 (8) | 0.800 |",
                 "| float16 | 1 × 16 × 16384 | 128 | 20.000 | 22.000 (9) | 1.100 |",
                 "Geometric mean 0.938. `DQ_PARTS_TILE_COST`",
                 "| 77 passed in 70.2s |", "| fwd | 1.50× (1) | 2.50× (1) | — |"):  # earlier stages kept
        assert text in md, text


def test_without_a_gpu_it_says_to_use_the_dry_run(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(H100, gpu_count=0, gpu=None,
                                                               cupy_error="no driver"))
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.md").exists()


@pytest.mark.parametrize("argv, named", [(["--only", "bench", "lint"], "'lint'"),
                                         (["--bench-cap", "5"], "'5'"),
                                         (["--seqlens", "0"], "'0'"),
                                         (["--workers", "0"], "0")])
def test_bad_arguments_are_named(gpu_check, capsys, argv, named):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(argv)
    err = capsys.readouterr().err
    assert argv[0] in err and named in err


FAKE_SANITIZER = """#!/usr/bin/env bash
# compute-sanitizer --tool CHECK --error-exitcode 99 --target-processes all PROGRAM...
check=$2; shift 6
CHECK=$check "$@"; rc=$?
n=0; [ "$check" = racecheck ] && n=2
echo "========= ERROR SUMMARY: $n errors"
[ $n -gt 0 ] && exit 99
exit $rc
"""
FAKE_PYTHON = """#!/usr/bin/env bash
# a machine with one GPU as far as sanitize_gpu.sh's device check goes
case "$2" in *getDeviceCount*) exit 0 ;; esac
exec {python} "$@"
"""
GPU_TESTS = """
import os, time, pytest

@pytest.mark.gpu
def test_runs():
    pass

@pytest.mark.gpu
def test_skips():
    pytest.skip("not here")

@pytest.mark.gpu
def test_hangs():   # under every tool, or HANG_ONLY's
    if os.environ.get("HANG_ONLY", os.environ["CHECK"]) == os.environ["CHECK"]:
        time.sleep(60)
"""


def test_sanitize_script_reports_each_tool(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    (tmp_path / "test_fake_gpu.py").write_text(GPU_TESTS)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHON=str(bin_dir / "python"))

    def run(*args, **extra_env):
        proc = subprocess.run(["bash", str(REPO / "tools" / "sanitize_gpu.sh"), *args,
                               str(tmp_path / "test_fake_gpu.py")], env=dict(env, **extra_env),
                              capture_output=True, text=True, timeout=300)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("sanitize_gpu: ")]
        return proc.returncode, lines

    rc, lines = run("-k", "not hangs")
    assert rc == 1   # racecheck's findings fail the run
    assert [l.split(" tests=")[0] for l in lines] == [
        "sanitize_gpu: memcheck: exit=0 errors=0", "sanitize_gpu: synccheck: exit=0 errors=0",
        "sanitize_gpu: racecheck: exit=99 errors=2"]
    assert all("tests=[1 passed, 1 skipped, 1 deselected" in l for l in lines)

    rc, lines = run("--timeout", "10")
    assert rc == 1
    assert lines == [f"sanitize_gpu: {c}: exit=124 errors=? tests=[1 passed, 1 skipped so far, stopped]"
                     for c in ("memcheck", "synccheck", "racecheck")]

    # --budget: memcheck and synccheck first; racecheck, last, stops at what they left
    # (25 s less their few seconds), not at a third of it
    start = time.monotonic()
    rc, lines = run("--budget", "25", HANG_ONLY="racecheck")
    assert rc == 1
    assert [l.split(" tests=")[0] for l in lines] == [
        "sanitize_gpu: memcheck: exit=0 errors=0", "sanitize_gpu: synccheck: exit=0 errors=0",
        "sanitize_gpu: racecheck: exit=124 errors=?"]
    assert time.monotonic() - start > 15
