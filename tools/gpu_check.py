#!/usr/bin/env python3
"""Everything one CUDA machine can tell about cuflash, in one command, without a network
and from a plain checkout (no install: the repository goes on PYTHONPATH).

Sections, in this order, each under a time cap:
  tests     pytest -m gpu (in parallel with pytest-xdist where installed)
  sanitize  tools/sanitize_gpu.sh: memcheck, synccheck and racecheck over a selection of
            the GPU tests, sharing the section's cap (racecheck, the slowest, last)
  bench     benchmarks/bench_gpu.py: cuflash against every installed peer (PyTorch SDPA's
            flash, cuDNN and memory-efficient backends, JAX's cuDNN attention, flash-attn),
            forward, backward and forward+backward; sizes stop being added when its
            budget is spent
  workers   benchmarks/bench_dq_workers.py --counts model: the mma.sync backward's five GEMMs
            against its two kernels, which decides DQ_PARTS_TILE_COST (the default backward
            off sm_90)
  capture   tools/capture_tensor_cores.py: mma.sync's (and on an H100 wgmma's) block dot
            products, recorded for the emulator's tensor-core model (tensor-core/)

With the default caps the whole run takes at most about 9½ minutes: one command of 10
minutes at most, on an H100 (tests about 40 s, memcheck about 70 s cold, synccheck 10 s,
racecheck what is left; the benchmark its whole cap; the workers about 40 s; the capture a
few seconds). Where commands are shorter, run it in stages that share --out, e.g.
  python3 tools/gpu_check.py --only tests sanitize
  python3 tools/gpu_check.py --only bench workers capture

Writes under --out (benchmarks/results/ by default):
  bench_gpu.csv    every measurement, and for each missing one why (bench_gpu.py)
  bench_gpu.png    TFLOP/s over N per dtype, causal, pass and d
  bench_dq_workers.csv  the backward per worker count (bench_dq_workers.py)
  gpu_check.md     the summary: device, driver, CUDA, CuPy/PyTorch/JAX versions, test and
                   sanitizer counts, cuflash's TFLOP/s and its ratio to each peer
  gpu_check.json   each section's result; a stage updates its own sections only, so the
                   summary covers every section either stage ran
  gpu_check.log    the full output, appended

--dry-run needs no GPU: the machine's software, how many GPU tests would run, where
compute-sanitizer is, which peers are importable, the benchmark's plan and cuflash
validated in the CPU emulator. It writes nothing that claims a timing (only the
benchmark's bench_gpu_plans.csv).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SECTIONS = ("tests", "sanitize", "bench", "workers", "capture")
# Seconds per section: all four fit a 10-minute command, with room for the start and the
# summary.
CAPS = {"tests": 120, "sanitize": 210, "bench": 150, "workers": 60, "capture": 30}
# The sanitizer's selection, most telling first (a tool stopped at its cap has done
# these): the forward kernels (the Hopper ones too) and the backward ones against the
# reference over dtypes and odd shapes, a score_mod and mask_mod compiled in (a block mask
# and buffer gradients too), then split-KV,
# varlen and the paged KV cache; all small shapes.
SANITIZE_SELECTION = ("tests/test_api.py::test_forward_matches_reference",
                      "tests/test_kernels_sm90.py", "tests/test_kernels_sm90_bwd.py",
                      "tests/test_programmable_kernels.py::test_on_the_gpu",
                      "tests/test_block_mask_kernels.py::test_on_the_gpu",
                      "tests/test_api.py::test_backward_matches_reference",
                      "tests/test_kernels_backward.py", "tests/test_serving.py")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


# ── the machine ──────────────────────────────────────────────────────────────────────

def _version(dist):
    for name in (dist if isinstance(dist, tuple) else (dist,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def _cuda_version(v):
    """12090 -> '12.9'."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else None


def _nvidia_smi():
    exe = shutil.which("nvidia-smi") or next(
        (p for p in ("/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi")
         if os.path.exists(p)), None)
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out[0].split(",")] if out else []
    return dict(zip(("gpu", "driver", "gpu_memory"), parts)) if len(parts) == 3 else {}


def environment():
    """The machine's GPU and software, each field on its own so one failure hides nothing."""
    from cuflash import compiler
    env = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(),
           "cupy": _version(("cupy-cuda13x", "cupy-cuda12x", "cupy")),
           "torch": _version("torch"), "jax": _version("jax"), "jaxlib": _version("jaxlib"),
           "flash_attn": _version("flash-attn"), "ml_dtypes": _version("ml_dtypes"),
           "cuda_headers": compiler.cuda_include_dir(),
           "cuda_headers_version": _cuda_version(compiler.cuda_version()),
           "gpu_count": 0, **_nvidia_smi()}
    try:
        import cupy
        rt = cupy.cuda.runtime
        env["nvrtc"] = "%d.%d" % cupy.cuda.nvrtc.getVersion()
        env["cuda_runtime"] = _cuda_version(rt.runtimeGetVersion())
        env["driver_cuda"] = _cuda_version(rt.driverGetVersion())
        env["gpu_count"] = rt.getDeviceCount()
        if env["gpu_count"]:
            p = rt.getDeviceProperties(0)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            env.update(gpu=name, cc=f"{p['major']}.{p['minor']}", sms=p["multiProcessorCount"],
                       gpu_memory=env.get("gpu_memory") or f"{p['totalGlobalMem'] / 2**30:.1f} GiB")
    except Exception as e:  # no CuPy, no driver, no device
        env["cupy_error"] = f"{type(e).__name__}: {e}"[:200]
    if env["torch"]:
        try:
            import torch
            env["torch_cuda"] = torch.version.cuda
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception as e:
            env["torch_error"] = f"{type(e).__name__}: {e}"[:200]
    return env


# ── running a section ────────────────────────────────────────────────────────────────

def run_logged(cmd, timeout, log):
    """Run `cmd` in the repository with the checkout on PYTHONPATH, echoing its output to
    stdout and `log`; stop its whole process group after `timeout` seconds.
    Returns (exit code, output, seconds, timed out)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHON=sys.executable,   # sanitize_gpu.sh's
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print(f"$ {' '.join(map(str, cmd))}", file=log, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            log.write(line)
        sys.stdout.flush()
        log.flush()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=10)
    seconds = time.perf_counter() - start
    if timed_out:
        note = f"gpu_check: stopped after {timeout:.0f} s (the section's cap)\n"
        if lines and not lines[-1].endswith("\n"):
            note = "\n" + note
        lines.append(note)
        print(note, end="", file=log, flush=True)
        print(note, end="", flush=True)
    return proc.returncode, "".join(lines), seconds, timed_out


_RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_TEST_ID = re.compile(r"(\S+::\S+)")
_CLOSING = re.compile(r"^=*\s*((?:no tests ran|\d+ \w+.*?) in [\d.]+s(?: \([^)]*\))?)\s*=*\s*$")
_WORDS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
          "XFAIL": "xfailed", "XPASS": "xpassed"}


def parse_pytest(text):
    """Counts of a verbose pytest run's outcomes from its output: the closing line's where
    pytest got that far, else one per test id seen so far (a run stopped at its cap).
    Returns {"counts", "complete", "closing", "failures"}."""
    closing = None
    last = {}
    for line in text.splitlines():
        m = _CLOSING.match(line.strip())
        if m:
            closing = m.group(1)
            continue
        r, t = _RESULT.search(line), _TEST_ID.search(line)
        if r and t:
            word = _WORDS[r.group(1)]
            # a test that passed and then failed its teardown counts as the error
            if last.get(t.group(1)) != "error":
                last[t.group(1)] = word
    counts = dict.fromkeys(OUTCOMES, 0)
    if closing:
        for n, word in re.findall(r"(\d+) (\w+)", closing):
            word = {"errors": "error", "warning": None, "warnings": None}.get(word, word)
            if word in counts:
                counts[word] = int(n)
    else:
        for word in last.values():
            counts[word] += 1
    failures = sorted(t for t, w in last.items() if w in ("failed", "error"))
    return {"counts": counts, "complete": closing is not None, "closing": closing,
            "failures": failures}


def run_tests(args, log):
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-rfE"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append("--timeout=300")  # a hung test fails alone
    if args.workers > 1 and importlib.util.find_spec("xdist"):
        # NVRTC compiles one kernel at a time per process: workers compile in parallel
        cmd += ["-n", str(args.workers)]
    rc, text, seconds, timed_out = run_logged(cmd, args.cap["tests"], log)
    res = parse_pytest(text)
    ok = rc == 0 and not timed_out and res["complete"] and sum(res["counts"].values()) > 0
    return {**res, "exit": rc, "seconds": round(seconds), "timed_out": timed_out, "ok": ok,
            "command": " ".join(["python", *cmd[1:]])}


_SANITIZE = re.compile(r"^sanitize_gpu: (\w+): exit=(\S+) errors=(\S+) tests=\[(.*)\]$", re.M)


def parse_sanitize(text):
    """{tool: {"exit", "errors", "tests"}} from sanitize_gpu.sh's closing line per tool."""
    return {tool: {"exit": int(rc) if rc.lstrip("-").isdigit() else None,
                   "errors": int(errors) if errors.isdigit() else None, "tests": tests}
            for tool, rc, errors, tests in _SANITIZE.findall(text)}


def sanitize_budget(args):
    """The three tools' seconds: the sanitize cap, less the 10 s the last one's stop may
    take."""
    return max(30, args.cap["sanitize"] - 10)


def run_sanitize(args, log):
    budget = sanitize_budget(args)
    cmd = ["bash", "tools/sanitize_gpu.sh", "--budget", str(budget), *SANITIZE_SELECTION]
    rc, text, seconds, timed_out = run_logged(cmd, args.cap["sanitize"] + 30, log)
    tools = parse_sanitize(text)
    ok = (rc == 0 and len(tools) == 3
          and all(t["exit"] == 0 and t["errors"] == 0 for t in tools.values()))
    skipped = None if tools else (text.strip().splitlines() or ["no output"])[-1]
    return {"tools": tools, "exit": rc, "seconds": round(seconds), "timed_out": timed_out,
            "ok": ok, "skipped": skipped, "budget": budget, "command": " ".join(cmd[1:])}


def bench_args(args):
    out = []
    for flag in ("dtype", "d", "seqlens", "peers"):
        if getattr(args, flag) is not None:
            out += [f"--{flag}", *map(str, getattr(args, flag))]
    if args.causal is not None:
        out += ["--causal", args.causal]
    return out


def run_bench(args, log):
    # the budget leaves a minute for the configuration in flight when it runs out, the
    # CSV and the plot; past cap + 30 s the run is stopped (a hang)
    budget = bench_budget(args)
    for stale in ("bench_gpu.csv", "bench_gpu.png"):   # a run that fails must not show the last one's
        (args.out / stale).unlink(missing_ok=True)
    cmd = [sys.executable, "benchmarks/bench_gpu.py", *bench_args(args),
           "--budget", str(budget), "--out", str(args.out)]
    rc, text, seconds, timed_out = run_logged(cmd, args.cap["bench"] + 30, log)
    return {"exit": rc, "seconds": round(seconds), "timed_out": timed_out,
            "ok": rc == 0 and not timed_out, "command": " ".join(["python", *map(str, cmd[1:])]),
            "budget": budget}


def bench_budget(args):
    return args.cap["bench"] - 60


def run_workers(args, log):
    (args.out / "bench_dq_workers.csv").unlink(missing_ok=True)  # not the last run's
    cmd = [sys.executable, "benchmarks/bench_dq_workers.py", "--counts", "model",
           "--out", str(args.out)]
    rc, text, seconds, timed_out = run_logged(cmd, args.cap["workers"], log)
    return {"exit": rc, "seconds": round(seconds), "timed_out": timed_out,
            "ok": rc == 0 and not timed_out, "command": " ".join(["python", *map(str, cmd[1:])])}


def run_capture(args, log):
    cmd = [sys.executable, "tools/capture_tensor_cores.py", "--out", str(args.out / "tensor-core")]
    rc, text, seconds, timed_out = run_logged(cmd, args.cap["capture"], log)
    captures = re.findall(r"^(\S+): (\d+) samples$", text, re.M)
    return {"exit": rc, "seconds": round(seconds), "timed_out": timed_out, "ok": rc == 0 and bool(captures),
            "captures": [f"{pathlib.Path(p).parent.name}/{pathlib.Path(p).name}: {n}" for p, n in captures],
            "command": " ".join(["python", *map(str, cmd[1:])])}


# ── the summary ──────────────────────────────────────────────────────────────────────

def _geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def machine_table(env):
    def row(label, value):
        return f"| {label} | {value if value not in (None, '') else '—'} |"
    gpu = env.get("gpu") or f"none visible ({env.get('cupy_error', 'CuPy sees 0 devices')})"
    if env.get("cc"):
        gpu += f", compute capability {env['cc']}, {env.get('sms')} SMs"
    if env.get("gpu_memory"):
        gpu += f", {env['gpu_memory']}"
    driver = env.get("driver") or "—"
    if env.get("driver_cuda"):
        driver += f" (supports CUDA {env['driver_cuda']})"
    torch = env.get("torch") or "not installed"
    if env.get("torch") and env.get("torch_cuda"):
        torch += f" (CUDA {env['torch_cuda']}, cuDNN {env.get('cudnn')})"
    jax = env.get("jax") or "not installed"
    if env.get("jax"):
        jax += f" (jaxlib {env.get('jaxlib')})"
    headers = env.get("cuda_headers") or "not found"
    if env.get("cuda_headers_version"):
        headers += f" (CUDA {env['cuda_headers_version']})"
    return "\n".join([
        "| | |", "|---|---|", row("GPU", gpu), row("driver", driver),
        row("CUDA runtime (CuPy's)", env.get("cuda_runtime")), row("NVRTC", env.get("nvrtc")),
        row("CUDA headers (cuflash's)", headers), row("Python", env.get("python")),
        row("CuPy", env.get("cupy")), row("PyTorch", torch), row("JAX", jax),
        row("flash-attn", env.get("flash_attn") or "not installed"),
        row("host, date", f"{env.get('host')}, {env.get('when')}")])


def _when(sec):
    return f"{sec.get('when', '?')} on {sec.get('gpu') or '?'}"


def tests_markdown(sec):
    c = sec["counts"]
    counts = ", ".join(f"{n} {w}" for w, n in c.items() if n) or "no tests ran"
    head = f"**{'PASS' if sec['ok'] else 'FAIL'}**: {counts} in {sec['seconds']} s"
    if sec["timed_out"]:
        head += f", stopped at the {sec.get('cap', '?')} s cap (counts so far)"
    lines = [f"`{sec['command']}` ({_when(sec)})", "", head + f" (exit {sec['exit']})."]
    if sec["failures"]:
        lines += ["", "Failed or errored:"] + [f"- `{t}`" for t in sec["failures"][:30]]
        if len(sec["failures"]) > 30:
            lines.append(f"- … {len(sec['failures']) - 30} more in gpu_check.log")
    return "\n".join(lines)


def sanitize_verdict(sec):
    """PASS: three tools, no error; INCOMPLETE: no error in what ran, but a tool stopped at
    its cap; FAIL: an error, a failing test or a run that went wrong."""
    if sec["ok"]:
        return "PASS"
    tools = sec["tools"].values()
    if tools and all(t["exit"] in (0, 124) and not t["errors"] for t in tools):
        return "INCOMPLETE: no sanitizer error in what ran; a tool stopped at the cap"
    return "FAIL"


def sanitize_markdown(sec):
    lines = [f"`{sec['command']}` ({_when(sec)}): the three tools within {sec['budget']} s, "
             "racecheck last.", ""]
    if sec.get("skipped"):
        return "\n".join(lines + [f"**NOT RUN**: {sec['skipped']}"])
    lines += [f"**{sanitize_verdict(sec)}** (exit {sec['exit']}).", "",
              "| tool | sanitizer errors | tests | exit |", "|---|---|---|---|"]
    for tool in ("memcheck", "racecheck", "synccheck"):
        t = sec["tools"].get(tool)
        if t is None:
            lines.append(f"| {tool} | — | did not run | — |")
        else:
            errors = "? (stopped before its summary)" if t["errors"] is None else t["errors"]
            exit_ = {124: "124 (stopped at the cap)", 99: "99 (sanitizer errors)"}.get(t["exit"], t["exit"])
            lines.append(f"| {tool} | {errors} | {t['tests']} | {exit_} |")
    return "\n".join(lines)


_CELL = {"unavailable": "n/a", "unsupported": "unsup.", "invalid": "INVALID", "error": "error",
         "budget": "—"}


def bench_markdown(sec, rows):
    from bench_gpu import MODES, ratios
    lines = [f"`{sec['command']}` ({_when(sec)}), exit {sec['exit']}"
             + (", stopped at its cap" if sec["timed_out"] else "") + ".", ""]
    if not rows:
        return "\n".join(lines + ["No bench_gpu.csv: nothing was measured."])
    table = ratios(rows)
    peers = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "cuflash"))
    status = {(r["impl"], r["dtype"], r["causal"], r["d"], r["N"], r["mode"]): r for r in rows}
    timed = [r for r in rows if r["status"] == "ok"]
    lines.append(f"{len(timed)} of {len(rows)} measurements timed "
                 f"({', '.join(f'{n} {s}' for s, n in _count(r['status'] for r in rows))}).")
    left = [r for r in rows if r["status"] == "budget"]
    if left:
        first = min(left, key=lambda r: r["N"])
        sizes = " ".join(str(n) for n in sorted({r["N"] for r in left}))
        lines.append(f"The time budget ({sec.get('budget', '?')} s) ran out: "
                     f"{len({(r['dtype'], r['causal'], r['d'], r['N']) for r in left})} "
                     f"configuration(s) from N = {first['N']} on were not timed "
                     f"(`bench_gpu.py --seqlens {sizes}` times them alone).")
    bad = [r for r in rows if r["impl"] == "cuflash" and r["status"] in ("invalid", "error")]
    if bad:
        lines.append(f"**cuflash failed {len(bad)} measurements** (status invalid/error below).")
    lines += ["", "Geometric mean of cuflash's rate over each peer's (> 1: cuflash faster), over "
              "the configurations both ran:", "",
              "| pass | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
    for mode in MODES:
        cells = []
        for p in peers:
            got = [v[p] for k, v in table.items() if k[-1] == mode and p in v]
            cells.append(f"{_geomean(got):.2f}× ({len(got)})" if got else "—")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "cuflash's TFLOP/s and its rate over each peer's per configuration "
              "(n/a: peer not available; unsup.: it refuses the dtype or shape; —: not timed, "
              "budget spent):", "",
              "| dtype | causal | d | N | pass | cuflash TFLOP/s | " + " | ".join(peers) + " |",
              "|---" * (6 + len(peers)) + "|"]
    for r in rows:
        if r["impl"] != "cuflash":
            continue
        key = (r["dtype"], r["causal"], r["d"], r["N"], r["mode"])
        rate = f"{r['tflops']:.1f}" if r["status"] == "ok" else _CELL.get(r["status"], r["status"])
        cells = []
        for p in peers:
            if p in table.get(key, {}):
                cells.append(f"{table[key][p]:.2f}×")
            else:
                other = status.get((p, *key))
                cells.append(_CELL.get(other["status"], "?") if other and other["status"] != "ok"
                             else "—")
        lines.append(f"| {key[0]} | {'yes' if key[1] else 'no'} | {key[2]} | {key[3]} | {key[4]} "
                     f"| {rate} | " + " | ".join(cells) + " |")
    notes = _count(f"{r['impl']}: {r['status']}: {r['note']}" for r in rows
                   if r["status"] not in ("ok", "budget"))
    if notes:
        lines += ["", "Why some measurements are missing (count of rows):", ""]
        lines += [f"- {text} ({n})" for text, n in notes]
    lines += ["", "![TFLOP/s over N](bench_gpu.png)"]
    return "\n".join(lines)


def workers_markdown(sec, rows):
    from bench_dq_workers import best_over_two_kernels
    from cuflash.plans.device import DQ_PARTS_TILE_COST
    lines = [f"`{sec['command']}` ({_when(sec)}), exit {sec['exit']}"
             + (", stopped at its cap" if sec["timed_out"] else "") + ".", ""]
    best = best_over_two_kernels(rows)
    if not best:
        return "\n".join(lines + ["No bench_dq_workers.csv with both backwards: nothing to compare."])
    lines += ["The mma.sync backward (not the Hopper one): the fastest 5-GEMM worker count "
              "against the two kernels, ms per backward (< 1: five GEMMs faster):", "",
              "| dtype | B × H × N | d | two kernels | five GEMMs (W) | ratio |",
              "|---|---|---|---|---|---|"]
    for (B, H, N, d, dtype), (w, ms, two) in best.items():
        lines.append(f"| {dtype} | {B} × {H} × {N} | {d} | {two:.3f} | {ms:.3f} ({w}) "
                     f"| {ms / two:.3f} |")
    ratios = [ms / two for w, ms, two in best.values()]
    lines += ["", f"Geometric mean {_geomean(ratios):.3f}. `DQ_PARTS_TILE_COST` "
              f"(plans/device.py) is {DQ_PARTS_TILE_COST}: the model weighs a 5-GEMM tile as "
              "that many two-kernel tiles, so at 1 the default backward off sm_90 is the "
              "two-kernel one; ratios below 1 argue for the measured value."]
    return "\n".join(lines)


def _count(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return list(out.items())


def summary_markdown(state, rows, worker_rows=()):
    env = state.get("environment", {})
    parts = [f"# cuflash on {env.get('gpu') or 'a machine without a visible GPU'}", "",
             "Written by `python3 tools/gpu_check.py`; every number below comes from the "
             "sections' own runs (gpu_check.json, bench_gpu.csv, gpu_check.log).", "",
             "## Machine", "", machine_table(env)]
    titles = {"tests": "GPU tests (`pytest -m gpu`)", "sanitize": "compute-sanitizer",
              "bench": "Benchmark (`benchmarks/bench_gpu.py`)",
              "workers": "The backward's five GEMMs against two kernels (`benchmarks/bench_dq_workers.py`)",
              "capture": "Tensor-core captures (`tools/capture_tensor_cores.py`)"}
    for name in SECTIONS:
        parts += ["", f"## {titles[name]}", ""]
        sec = state.get(name)
        if sec is None:
            parts.append(f"Not run yet: `python3 tools/gpu_check.py --only {name}`.")
        elif "crash" in sec:
            parts.append(f"**FAIL**: gpu_check could not run it ({sec['crash']}); see gpu_check.log.")
        elif name == "tests":
            parts.append(tests_markdown(sec))
        elif name == "sanitize":
            parts.append(sanitize_markdown(sec))
        elif name == "capture":
            parts.append(f"`{sec['command']}` ({_when(sec)}): **{'PASS' if sec['ok'] else 'FAIL'}** "
                         f"(exit {sec['exit']}); samples per capture, under tensor-core/:")
            parts += [""] + [f"- {c}" for c in sec["captures"]]
        elif name == "workers":
            parts.append(workers_markdown(sec, worker_rows))
        else:
            parts.append(bench_markdown(sec, rows))
    return "\n".join(parts) + "\n"


# ── the command ──────────────────────────────────────────────────────────────────────

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    metavar="SECTION", help=f"run these sections only: {', '.join(SECTIONS)}")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the plan, nothing timed")
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results",
                    help="where the CSV, plot, summary, state and log go (default: %(default)s)")
    for name in SECTIONS:
        ap.add_argument(f"--{name}-cap", type=_seconds, default=CAPS[name], metavar="S",
                        help=f"seconds for the {name} section (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="pytest-xdist workers for the tests (default: %(default)s)")
    bench = ap.add_argument_group("benchmark sizes (default: bench_gpu.py's full sweep)")
    bench.add_argument("--dtype", nargs="+", choices=("float16", "bfloat16", "float32"))
    bench.add_argument("--d", nargs="+", type=_positive)
    bench.add_argument("--seqlens", nargs="+", type=_positive)
    bench.add_argument("--causal", choices=("both", "true", "false"))
    bench.add_argument("--peers", nargs="*", choices=_bench_peers())
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"argument --workers: expected a positive integer, got {args.workers}")
    args.cap = {name: getattr(args, f"{name}_cap") for name in SECTIONS}
    args.out = args.out.resolve()
    return args


def _bench_peers():
    """bench_gpu.py's peers (PEERS, then EXTRA_PEERS), read from its source: importing it
    would import NumPy and cuflash before the environment section has looked at them."""
    import ast
    tree = ast.parse((REPO / "benchmarks" / "bench_gpu.py").read_text())
    found = {t.id: ast.literal_eval(node.value) for node in tree.body
             if isinstance(node, ast.Assign) for t in node.targets
             if isinstance(t, ast.Name) and t.id in ("PEERS", "EXTRA_PEERS")}
    return found["PEERS"] + found["EXTRA_PEERS"]


def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _seconds(text):
    if not text.isdigit() or int(text) < 30:
        raise argparse.ArgumentTypeError(f"expected whole seconds, at least 30; got {text!r}")
    return int(text)


def dry_run(args, log):
    """What a GPU run would do, and everything of it that needs no GPU."""
    print("gpu_check --dry-run: nothing is timed and no summary is written.\n")
    env = environment()
    print(machine_table(env) + "\n")
    results = {}

    print(f"[tests] would run `pytest -m gpu` (cap {args.cap['tests']} s):")
    n = collect(["-m", "gpu"], log)
    ok = {"tests": n > 0}
    results["tests"] = f"{n} GPU tests would run" if n else "collecting the GPU tests failed"
    print(f"[tests] {results['tests']}\n")

    print(f"[sanitize] would run tools/sanitize_gpu.sh (cap {args.cap['sanitize']} s):")
    rc, text, _, _ = run_logged(["bash", "tools/sanitize_gpu.sh", "--dry-run", "--budget",
                                 str(sanitize_budget(args)), *SANITIZE_SELECTION], 120, log)
    tool = re.search(r"compute-sanitizer: (.*)", text)
    n = collect(["-m", "gpu", *SANITIZE_SELECTION], log)
    ok["sanitize"] = rc == 0 and tool is not None and n > 0
    results["sanitize"] = (f"{n} GPU tests under each of memcheck, synccheck, racecheck; "
                           f"compute-sanitizer {tool.group(1) if tool else '?'}" if ok["sanitize"]
                           else f"sanitize_gpu.sh --dry-run failed (exit {rc}, {n} tests)")
    print(f"[sanitize] {results['sanitize']}\n")

    print(f"[bench] would run benchmarks/bench_gpu.py (budget {bench_budget(args)} s):")
    rc, text, _, _ = run_logged([sys.executable, "benchmarks/bench_gpu.py", "--dry-run",
                                 *bench_args(args), "--budget", str(bench_budget(args)),
                                 "--out", str(args.out)], 1800, log)
    ok["bench"] = rc == 0
    results["bench"] = ("plan written, cuflash validated in the emulator" if ok["bench"]
                        else f"bench_gpu.py --dry-run failed (exit {rc})")
    print(f"[bench] {results['bench']}\n")

    print(f"[workers] would run benchmarks/bench_dq_workers.py --counts model (cap {args.cap['workers']} s):")
    rc, text, _, _ = run_logged([sys.executable, "benchmarks/bench_dq_workers.py", "--dry-run",
                                 "--counts", "model"], 120, log)
    n = len(re.findall(r"^  B=.*, W = 0\b", text, re.M))
    ok["workers"] = rc == 0 and n > 0
    results["workers"] = (f"{n} shapes planned (five GEMMs against two kernels)" if ok["workers"]
                          else f"bench_dq_workers.py --dry-run failed (exit {rc})")
    print(f"[workers] {results['workers']}\n")

    print("[capture] would run tools/capture_tensor_cores.py; in the emulator (sm_90a) here:")
    with tempfile.TemporaryDirectory() as tmp:
        rc, text, _, _ = run_logged([sys.executable, "tools/capture_tensor_cores.py", "--emulator", "sm_90a",
                                     "--samples", "64", "--out", tmp], 600, log)
    n = len(re.findall(r": \d+ samples$", text, re.M))
    ok["capture"] = rc == 0 and n == 6
    results["capture"] = (f"{n} captures (mma.sync and wgmma, fp16/bf16/tf32) recorded in the emulator"
                          if ok["capture"] else f"capture_tensor_cores.py --emulator failed (exit {rc})")
    print(f"[capture] {results['capture']}\n")

    print("gpu_check --dry-run summary:")
    for name in SECTIONS:
        print(f"  {name:9s} {'ok' if ok[name] else 'FAILED'}: {results[name]}")
    print("no GPU timings exist from this run")
    return 0 if all(ok.values()) else 1


def collect(selection, log):
    """How many tests pytest would run for `selection` (0 where collection fails)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-qq", "-p", "no:cacheprovider",
           *selection]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}", file=log, flush=True)
    # -qq prints one "path: count" line per file
    counts = re.findall(r"^\S+\.py: (\d+)$", proc.stdout, re.M)
    return sum(map(int, counts)) if proc.returncode == 0 else 0


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu_check.log", "a") as log:
        print(f"\n### gpu_check {' '.join(argv if argv is not None else sys.argv[1:])} "
              f"at {datetime.datetime.now().isoformat(timespec='seconds')}", file=log)
        if args.dry_run:
            return dry_run(args, log)
        env = environment()
        if not env["gpu_count"]:
            print("gpu_check: no CUDA GPU visible to CuPy "
                  f"({env.get('cupy_error', 'CuPy sees 0 devices')}); use --dry-run here.",
                  file=sys.stderr)
            return 2
        print(machine_table(env))
        state_path = args.out / "gpu_check.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        state["environment"] = env
        runners = {"tests": run_tests, "sanitize": run_sanitize, "bench": run_bench,
                   "workers": run_workers, "capture": run_capture}
        for name in SECTIONS:
            if name not in args.only:
                continue
            print(f"\n=== gpu_check: {name} (cap {args.cap[name]} s) ===", flush=True)
            try:
                result = runners[name](args, log)
            except Exception as e:  # record it and go on to the next section
                result = {"ok": False, "crash": f"{type(e).__name__}: {e}"[:500]}
                print(f"gpu_check: the {name} section failed: {result['crash']}", file=sys.stderr)
            state[name] = {**result, "when": env["when"], "gpu": env.get("gpu"),
                           "cap": args.cap[name]}
            state_path.write_text(json.dumps(state, indent=1, default=str))
        rows = []
        csv_path = args.out / "bench_gpu.csv"
        if "bench" in state and csv_path.exists():
            from bench_gpu import plot, read_csv
            rows = read_csv(csv_path)
            if "bench" in args.only:
                plot(rows, args.out / "bench_gpu.png")  # also after a run cut short
        worker_rows = []
        if "workers" in state and (args.out / "bench_dq_workers.csv").exists():
            from bench_dq_workers import read_csv as read_workers
            worker_rows = read_workers(args.out / "bench_dq_workers.csv")
        try:
            text = summary_markdown(state, rows, worker_rows)
        except Exception as e:  # the sections' results are in the JSON and the log anyway
            text = (f"# cuflash GPU check\n\nWriting the summary failed ({type(e).__name__}: "
                    f"{e}); the results:\n\n```json\n{json.dumps(state, indent=1, default=str)}\n```\n")
        (args.out / "gpu_check.md").write_text(text)
        print("\n=== gpu_check summary ===")
        for name in SECTIONS:
            sec = state.get(name)
            verdict = ("not run" if sec is None else "ok" if sec["ok"] else
                       "incomplete" if name == "sanitize" and sanitize_verdict(sec) != "FAIL"
                       else "FAILED")
            ran = "" if sec is None or name in args.only else " (an earlier stage)"
            print(f"  {name:9s} {verdict}{ran}")
        print(f"wrote {args.out / 'gpu_check.md'}, gpu_check.json, gpu_check.log"
              + (", bench_gpu.csv, bench_gpu.png" if rows else "")
              + (", bench_dq_workers.csv" if worker_rows else ""))
        return 0 if all(state[n]["ok"] for n in args.only) else 1


if __name__ == "__main__":
    sys.exit(main())
