"""What the CPU emulator needs installed, how it says what is missing, and how a long launch
stops at Ctrl-C.

The header tests build fake wheel trees and toolkits in tmp_path and hide the real ones, so
they hold on any machine; which wheel ships which header is checked against the installed
wheels' own file lists, and the extras against setup.cfg.
"""
from __future__ import annotations

import _thread
import configparser
import importlib.metadata
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator
from cuflash.emulator import EmulatorError, RawModule, _headers

ROOT = Path(__file__).resolve().parents[1]
KDIR = Path(__file__).resolve().parent / "emulator_kernels"
HALF = r"""#include <cuda_fp16.h>
extern "C" __global__ void sq(const __half* a, float* b) { b[threadIdx.x] = __half2float(a[threadIdx.x]); }"""


def _real(subdir: str) -> Path:
    """An include directory of the installed nvidia-* wheels (the test extra installs them)."""
    for base in _headers._nvidia_dirs():
        if (base / subdir).is_dir():
            return base / subdir
    pytest.skip(f"needs the nvidia wheel with {subdir}")


@pytest.fixture
def only(monkeypatch, tmp_path):
    """only(wheels={subdir: wheel directory}, cupy=bool, **env): the emulator sees just these
    nvidia-* wheel directories (under the returned fake site-packages/nvidia), CuPy or not, and no
    toolkit but $CUDA_PATH/$CUDA_HOME as given."""
    def setup(wheels=(), cupy=False, **env):
        fake = tmp_path / "site" / "nvidia"
        fake.mkdir(parents=True)
        for sub, target in dict(wheels).items():
            (fake / sub).parent.mkdir(parents=True, exist_ok=True)
            (fake / sub).symlink_to(target, target_is_directory=True)
        nvidia = types.ModuleType("nvidia")
        nvidia.__path__ = [str(fake)]
        monkeypatch.setitem(sys.modules, "nvidia", nvidia)
        if not cupy:
            monkeypatch.setitem(sys.modules, "cupy", None)   # what `import cupy` finds without CuPy
        monkeypatch.setattr(_headers, "DEFAULT_TOOLKITS", ())
        for var in ("CUDA_PATH", "CUDA_HOME"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, str(value))
        return fake
    return setup


def _toolkit(root: Path, cudart: int, cccl_subdir: bool = False) -> Path:
    """A fake CUDA toolkit: the four headers the emulator looks for, CCCL where CUDA 13 keeps it."""
    inc = root / "include"
    for rel in ("cuda_fp16.h", "crt/host_defines.h", ("cccl/" if cccl_subdir else "") + "nv/target"):
        (inc / rel).parent.mkdir(parents=True, exist_ok=True)
        (inc / rel).write_text("// fake\n")
    (inc / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {cudart}\n")
    return root


# ---------------------------------------------------------------------------------------------
# which package provides which header, and the extras that install them
def test_header_table_matches_the_installed_wheels():
    # the wheels' RECORD files say which header each installed wheel ships
    seen = 0
    for header, (cu12, _) in _headers.PROVIDERS.items():
        try:
            files = importlib.metadata.files(cu12) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        assert any(str(f).endswith("/include/" + header) for f in files), (header, cu12)
        seen += 1
    cupy = next((d for d in ("cupy-cuda12x", "cupy-cuda13x") if _installed(d)), None)
    if cupy:
        assert any(str(f).endswith("/nv/target") for f in importlib.metadata.files(cupy))
    if not seen:
        pytest.skip("no nvidia-*-cu12 wheel installed")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("extra, cuda", [("cuda12", 0), ("cuda13", 1)])
def test_cuda_extras_install_every_header_the_emulator_needs(extra, cuda):
    # the README's first command installs cuflash[cuda12]; backend="emulator" must work after it
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = {re.split(r"[<>=!~\[; ]", r.strip())[0] for r in cfg["options.extras_require"][extra].splitlines()
            if r.strip() and not r.strip().startswith("#")}
    for header, providers in _headers.PROVIDERS.items():
        ok = providers[cuda] in reqs or (header == "nv/target" and ("cupy-cuda12x", "cupy-cuda13x")[cuda] in reqs)
        assert ok, f"cuflash[{extra}] does not install {header} ({providers[cuda]})"


# ---------------------------------------------------------------------------------------------
# availability() and the error message
def test_missing_crt_names_the_nvcc_wheel_and_the_places_searched(only):
    fake = only(wheels={"cuda_runtime": _real("cuda_runtime")}, cupy=True)
    ok, msg = emulator.availability()
    assert not ok
    assert "crt/host_defines.h" in msg and '"nvidia-cuda-nvcc-cu12==12.9.*"' in msg
    assert "nvidia-cuda-runtime-cu12==" not in msg and "nv/target" not in msg   # both are there
    assert "set CUDA_PATH" in msg and str(fake / "cuda_runtime" / "include") in msg
    with pytest.raises(EmulatorError) as ei:   # the same words from a build
        RawModule(code=HALF).get_function("sq")
    assert str(ei.value) == msg


def test_without_cupy_names_the_package_of_nv_target(only):
    # nvidia-cuda-runtime-cu12 and nvidia-cuda-nvcc-cu12 are installed: only CCCL is missing
    only(wheels={"cuda_runtime": _real("cuda_runtime"), "cuda_nvcc": _real("cuda_nvcc")}, cupy=False)
    ok, msg = emulator.availability()
    assert not ok
    assert "nv/target" in msg and '"nvidia-cuda-cccl-cu12==12.9.*"' in msg and "cupy-cuda12x" in msg
    assert "crt/host_defines.h" not in msg and "nvidia-cuda-nvcc-cu12==" not in msg
    assert "nvidia-cuda-runtime-cu12==" not in msg


def test_cuda13_wheels_get_cuda13_advice(only, tmp_path):
    # CUDA 13 wheels share one tree, nvidia/cu13/include; crt/ comes with nvidia-cuda-crt
    tree = tmp_path / "cu13"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "cuda_fp16.h").write_text("// fake\n")
    (tree / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    only(wheels={"cu13": tree}, cupy=False)
    ok, msg = emulator.availability()
    assert not ok
    assert '"nvidia-cuda-crt==13.0.*"' in msg and '"nvidia-cuda-cccl==13.0.*"' in msg and "cupy-cuda13x" in msg
    assert "cu12" not in msg.split("Searched")[0]


@pytest.mark.parametrize("var", ["CUDA_PATH", "CUDA_HOME"])
def test_a_toolkit_in_cuda_path_or_cuda_home_is_searched(only, tmp_path, var):
    # the advice of the message above: the toolkit's include/ supplies every header
    root = _toolkit(tmp_path / "cuda-12.4", 12040)
    only(**{var: root})
    ok, msg = emulator.availability()
    assert ok, msg
    assert "CUDA 12.4" in msg and str(root / "include") in msg
    assert _headers.search()[0] == [str(root / "include")]


def test_cuda13_toolkit_keeps_cccl_in_include_cccl(only, tmp_path):
    root = _toolkit(tmp_path / "cuda-13.0", 13000, cccl_subdir=True)
    only(CUDA_PATH=root)
    assert _headers.search()[0] == [str(root / "include"), str(root / "include" / "cccl")]


def test_crt_from_a_toolkit_completes_the_wheels(only, tmp_path):
    # the README's install before nvidia-cuda-nvcc-cu12 was part of cuflash[cuda12], plus CUDA_PATH
    root = tmp_path / "toolkit"
    (root / "include" / "crt").mkdir(parents=True)
    (root / "include" / "crt" / "host_defines.h").write_text("// fake\n")
    fake = only(wheels={"cuda_runtime": _real("cuda_runtime")}, cupy=True, CUDA_PATH=root)
    dirs = _headers.search()[0]
    assert dirs[:2] == [str(fake / "cuda_runtime" / "include"), str(root / "include")]
    assert emulator.availability()[0]


def test_no_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("CUFLASH_EMULATOR_CXX", "no-such-g++")
    ok, msg = emulator.availability()
    assert not ok and "'no-such-g++' was not found" in msg and "apt-get install g++" in msg


def test_availability_compiles_nothing(monkeypatch):
    # `python -m cuflash info` calls it: it must only look for files
    def refuse(*a, **k):
        raise AssertionError(f"availability() ran {a[0] if a else k}")
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    ok, msg = emulator.availability()
    assert ok, msg   # the test extras install every header


# ---------------------------------------------------------------------------------------------
# Ctrl-C during a launch
def _spin():
    return RawModule(path=str(KDIR / "spin.cu")).get_function("spin")


def _interrupt_after(delay: float, how: str) -> list:
    """Interrupts the main thread `delay` seconds from now; returns [the time it did]."""
    main, sent = threading.main_thread().ident, []

    def fire():
        time.sleep(delay)
        sent.append(time.perf_counter())
        if how == "SIGINT":
            signal.pthread_kill(main, signal.SIGINT)
        else:
            _thread.interrupt_main()

    threading.Thread(target=fire, daemon=True).start()
    return sent


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.parametrize("how", ["SIGINT", "interrupt_main"])
@pytest.mark.parametrize("grid, steps", [(4096, 500), (1, 2_000_000)], ids=["many-blocks", "one-long-block"])
def test_ctrl_c_stops_a_long_launch(monkeypatch, how, grid, steps):
    # uninterrupted, either launch takes about 30 s here; the NumPy backend stops within 10 ms
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        f = _spin()
        out = np.full(grid * 64, -1, np.float32)
        sent = _interrupt_after(0.3, how)
        with pytest.raises(KeyboardInterrupt):
            try:
                f((grid,), (64,), (out, np.int32(steps)))
            finally:
                stopped = time.perf_counter()
                while not sent:   # a launch that ended first must still take its interrupt here
                    time.sleep(0.01)
        assert stopped - sent[0] < 2.0
        assert (out == -1).any()   # cut short: some threads never wrote
        # no half-state: the next launch runs in full and is right
        small = np.full(3 * 64, -1, np.float32)
        f((3,), (64,), (small, np.int32(7)))
        np.testing.assert_array_equal(small, 7.0)
    finally:
        signal.signal(signal.SIGINT, previous)
