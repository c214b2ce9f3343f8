"""How cuflash's CUDA sources are compiled, in one place.

The run-time path (CuPy's RawModule on a GPU, or the CPU emulator) and the compile
gate (`python -m cuflash check-kernels`) build their option lists here, so the gate
compiles exactly what CuPy will.
"""
import functools
import os
import pathlib
import re
import shutil
import subprocess

KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels"

# The architectures the compile gate proves every specialization for.
GATE_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def host_cxx(*env_vars):
    """The host C++ compiler (the emulator's and the CPU kernels'): the first of
    `env_vars`, then $CXX, that is set, else g++. Returns (that name, its path on PATH
    or None)."""
    name = next((os.environ[v] for v in (*env_vars, "CXX") if os.environ.get(v)), "g++")
    return name, shutil.which(name)


@functools.cache
def host_cxx_version(path):
    """First line of `path --version` (part of every cache key)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "?"


@functools.cache
def cuda_include_dir():
    """The CUDA headers (cuda_fp16.h, cuda_bf16.h): the PyPI wheel's (CUDA 12:
    nvidia/cuda_runtime/include; CUDA 13+: nvidia/cu13/include), else CUDA_PATH's."""
    try:
        import nvidia
        bases = [pathlib.Path(b) for b in nvidia.__path__]
    except ImportError:
        bases = []
    wheel_dirs = [b / "cuda_runtime" / "include" for b in bases]
    wheel_dirs += sorted((inc for b in bases for inc in b.glob("cu[0-9]*/include")), reverse=True)
    roots = [pathlib.Path(r) / "include" for r in (os.environ.get("CUDA_PATH"), "/usr/local/cuda") if r]
    for inc in wheel_dirs + roots:
        if (inc / "cuda_fp16.h").exists():
            return str(inc)
    return None


@functools.cache
def cuda_version(include_dir=None):
    """CUDART_VERSION (12090 for CUDA 12.9) of the headers in `include_dir` (default:
    cuda_include_dir()), None where there are none."""
    include_dir = include_dir or cuda_include_dir()
    try:
        text = (pathlib.Path(include_dir) / "cuda_runtime_api.h").read_text(errors="replace")
    except (OSError, TypeError):
        return None
    m = re.search(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def cache_dir(kind):
    """Where cuflash keeps its compiled `kind` ("emulator", "compile_gate"):
    $CUFLASH_CACHE_DIR/kind, else $XDG_CACHE_HOME/cuflash/kind, else ~/.cache/cuflash/kind.
    Read at every call, so a changed environment takes effect at once."""
    root = os.environ.get("CUFLASH_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        # the XDG spec: a relative path in XDG_CACHE_HOME is invalid and ignored
        base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "cuflash")
    return pathlib.Path(root) / kind


def nvrtc_options(arch=None):
    """NVRTC options for every cuflash kernel; `arch` ("sm_80") only for the gate.

    CuPy's RawModule adds the architecture of the current device itself.
    """
    options = ["--std=c++17", f"-I{KERNEL_DIR}"]
    inc = cuda_include_dir()
    if inc is not None:
        options.append(f"-I{inc}")
    if arch is not None:
        options.append(f"-arch={arch}")
    return tuple(options)


def arch_specific_options(cc):
    """The option that opens a GPU's architecture-specific features to its kernels (sm_90a:
    wgmma, setmaxnreg), for compute capability `cc`. CuPy's RawModule appends its own
    -arch=sm_XY after the caller's options and cannot name an "a" target itself (its
    _get_arch_for_options_for_nvrtc takes int("90a")); given both, NVRTC compiles for the
    "a" target."""
    return ("-arch=sm_90a",) if tuple(cc) == (9, 0) else ()


@functools.cache
def read_source(filename):
    """The text of one kernel source file in cuflash/kernels/."""
    return (KERNEL_DIR / filename).read_text()
