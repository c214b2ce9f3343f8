"""The GPU benchmark's --dry-run runs end to end without a GPU and says so."""
import csv
import importlib.util
import pathlib

import pytest

from conftest import HAS_GXX

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


@pytest.mark.skipif(not HAS_GXX, reason="the dry run validates in the emulator, which needs g++")
def test_bench_gpu_dry_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--dry-run", "--dtype", "float16", "float32", "--d", "64",
                     "--seqlens", "512", "--causal", "true", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no GPU timings exist yet" in out and "FAILED" not in out
    rows = list(csv.DictReader(open(tmp_path / "bench_gpu_plans.csv")))
    by = {(r["dtype"], r["arch"]): r for r in rows}
    assert by[("float16", "sm_80")]["kernel"].startswith("flash_fwd_tc_kernel<__half, 64")
    assert by[("float16", "sm_70")]["path"].startswith("SIMT")
    assert not (tmp_path / "bench_gpu.csv").exists()  # nothing timed
