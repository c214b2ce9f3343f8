"""The CUDA headers that g++ needs to build an emulated kernel: where each is looked for, and
which package to install when one is missing."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

from .. import compiler
from ._errors import EmulatorError

# Toolkits searched after $CUDA_PATH and $CUDA_HOME.
DEFAULT_TOOLKITS = ("/usr/local/cuda",)

# What the shim includes that NVRTC has built in, with the wheel that provides it for CUDA 12
# and for CUDA 13+ (cuda_fp16.h stands for cuda_bf16.h and cuda_runtime_api.h beside it).
PROVIDERS = {
    "cuda_fp16.h": ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
    "crt/host_defines.h": ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-crt"),
    "nv/target": ("nvidia-cuda-cccl-cu12", "nvidia-cuda-cccl"),
}
_CUPY = ("cupy-cuda12x", "cupy-cuda13x")   # CuPy bundles CCCL, hence nv/target


class Place(NamedTuple):
    """An include directory that may hold some of the headers."""
    what: str     # "the nvidia-cuda-nvcc-cu12 wheel", "$CUDA_PATH/include", ...
    path: Path


def _nvidia_dirs() -> list:
    """The site-packages/nvidia directories of the nvidia-* wheels (a namespace package)."""
    try:
        import nvidia
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", ())]


def places() -> list:
    """Where the headers are looked for, in order: the installed wheels (as compiler.cuda_include_dir()
    does, so that the emulator and NVRTC see the same headers), CuPy's CCCL, then toolkits."""
    out = []
    for base in _nvidia_dirs():
        for sub, pkg in (("cuda_runtime", "nvidia-cuda-runtime-cu12"), ("cuda_nvcc", "nvidia-cuda-nvcc-cu12"),
                         ("cuda_cccl", "nvidia-cuda-cccl-cu12")):
            out.append(Place(f"the {pkg} wheel", base / sub / "include"))
        for inc in sorted(base.glob("cu[0-9]*/include"), reverse=True):   # CUDA 13+: one tree for all wheels
            out.append(Place(f"the nvidia-* {inc.parent.name} wheels", inc))
    out = [p for p in out if p.path.is_dir()]
    # find_spec locates CuPy without importing it (slow, and it may look for a GPU)
    try:
        cupy = importlib.util.find_spec("cupy")
    except ValueError:   # a stand-in module without a spec
        cupy = None
    if cupy is not None and cupy.origin:
        cccl = Path(cupy.origin).parent / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
        out.append(Place("CuPy's CCCL", cccl))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            out.append(Place(f"${var}/include", Path(os.environ[var]) / "include"))
    out += [Place("a CUDA toolkit", Path(root) / "include") for root in DEFAULT_TOOLKITS]
    return out


def find(header: str, where: list) -> Path | None:
    """The include directory of `where` that holds `header` (CUDA 13 toolkits keep CCCL in include/cccl)."""
    for p in where:
        for d in (p.path, p.path / "cccl"):
            if (d / header).exists():
                return d
    return None


def _missing(header: str, cuda: int | None) -> tuple:
    """(pip requirement, note) for a missing `header`: the wheel that ships it, pinned to the CUDA
    version of the headers found (12.9 where there are none)."""
    major, minor = divmod(cuda // 10, 100) if cuda else (12, 9)
    pkg = PROVIDERS[header][major >= 13]
    note = f"{header} (from the {pkg} wheel"
    if header == "nv/target":
        note += f", or CuPy, {_CUPY[major >= 13]}, which bundles it"
    return f"{pkg}=={major}.{minor}.*", note + ")"


def search() -> tuple:
    """(the include directories, in order, that hold the headers; (pip requirement, note) of each
    missing header; the places searched)."""
    where = places()
    found = {h: find(h, where) for h in PROVIDERS}
    cuda = compiler.cuda_version(str(found["cuda_fp16.h"])) if found["cuda_fp16.h"] else None
    dirs = list(dict.fromkeys(str(d) for d in found.values() if d is not None))
    missing = [_missing(h, cuda) for h, d in found.items() if d is None]
    return dirs, missing, where


def include_dirs() -> list:
    """The CUDA include directories for g++, or an EmulatorError saying what to install."""
    dirs, missing, where = search()
    if missing:
        pip = " ".join(f'"{req}"' for req, _ in missing)
        searched = [f"{p.what} ({p.path}{'' if p.path.is_dir() else ': does not exist'})" for p in where]
        searched += [f"${var} (not set)" for var in ("CUDA_PATH", "CUDA_HOME") if not os.environ.get(var)]
        notes = ", ".join(note for _, note in missing)
        raise EmulatorError(
            f"the CUDA emulator needs the CUDA header{'s' * (len(missing) > 1)} {notes}: "
            f"`pip install {pip}`, or set CUDA_PATH to a CUDA toolkit (its include directory holds them all). "
            f"Searched: {'; '.join(searched)}.")
    return dirs
