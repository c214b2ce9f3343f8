"""The compiled forward: FA2's loop for float32 on x86 CPUs with AVX-512 or AVX2, in
C++ (`flash_fwd_cpu.cpp`), built by the host's C++ compiler on first use.

Each thread runs whole Q tiles — Q Kᵀ, the online softmax and P̃ V on a score tile
that stays in the core's caches — with register-blocked vector loops, where the
NumPy tiles call OpenBLAS and NumPy's ufuncs once per step (`forward.py`). The
NumPy forward stays the path for float64, for the variants, for FA1's order, and
wherever the kernel is not available: no AVX2 with FMA, no compiler, a failed build
(`library` says why).

One source, built once per instruction set (`ISAS`); `CpuConfig.native` picks one or
"auto", the widest this CPU has. The library is built with `$CXX` (else g++) into
cuflash's cache (`compiler.cache_dir("cpu")`), keyed by the source, the flags and the
compiler's version, and loaded with ctypes, which lets go of the GIL for the call.
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .... import compiler
from ..arrays import CALL_BUFFERS
from ..expbase import numpy_dispatch
from ..pool import Once, run_tasks

SOURCE = Path(__file__).with_name("flash_fwd_cpu.cpp")
ISAS = {  # name: (the CPU features it needs, as NumPy names them; its compiler flags)
    "avx512": (("AVX512F", "FMA3"), ("-DCUFLASH_AVX512", "-mavx512f", "-mfma")),
    "avx2": (("AVX2", "FMA3"), ("-DCUFLASH_AVX2", "-mavx2", "-mfma")),
}
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-w")
CHOICES = ("auto", *ISAS, "off")
"""CpuConfig.native's values: the widest instruction set this CPU has, one by name, or
the NumPy tiles always."""

_f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
_i = ctypes.c_int


def best_isa():
    """The widest of ISAS this CPU has (NumPy's reading of it, the OS saving the
    registers), or None."""
    features = numpy_dispatch()[1]
    return next((isa for isa, (needs, _) in ISAS.items()
                 if all(features.get(f) for f in needs)), None)


def library(isa="auto"):
    """(the loaded library of `isa`, None) or (None, why it is not available)."""
    isa = best_isa() if isa == "auto" else isa
    if isa is None:
        return None, "this CPU has neither AVX-512F nor AVX2 with FMA"
    return _library(isa)


@functools.cache
def _library(isa):
    needs, isa_flags = ISAS[isa]
    features = numpy_dispatch()[1]
    missing = [f for f in needs if not features.get(f)]
    if missing:
        return None, f"this CPU has no {' or '.join(missing)} (needed by {isa})"
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if cxx is None:
        return None, f"no C++ compiler ({os.environ.get('CXX') or 'g++'!r} is not on PATH)"
    if not SOURCE.is_file():
        return None, f"the kernel source {SOURCE} is missing"
    flags = (*FLAGS, *isa_flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*flags, cxx, version):
        h.update(part.encode() + b"\0")
    cache = compiler.cache_dir("cpu")
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"flash_fwd_{isa}-{h.hexdigest()[:24]}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / "lib.so"
            r = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                return None, f"{cxx} failed on {SOURCE.name} ({isa}):\n{r.stderr.strip()}"
            os.replace(out, so)  # atomic: concurrent processes share the cache
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:  # e.g. a cache on a noexec mount
        return None, f"could not load {so}: {e}"
    lib.cuflash_layout.argtypes = [ctypes.POINTER(_i), ctypes.POINTER(_i)]
    lib.cuflash_layout.restype = None
    lib.cuflash_pack_kv.argtypes = [_f32p, _f32p, _i, _i, _f32p, _f32p]
    lib.cuflash_pack_kv.restype = None
    lib.cuflash_forward_rows.argtypes = [_f32p, _f32p, _f32p, _f32p, _f32p,
                                         _i, _i, _i, _i, _i, _i, ctypes.c_float, _i]
    lib.cuflash_forward_rows.restype = _i
    return lib, None


def packed_shapes(lib, Nk, d):
    """Shapes of one K/V head's packed Kᵀ panels and padded V (the source's layouts)."""
    width, panel = _i(), _i()
    lib.cuflash_layout(ctypes.byref(width), ctypes.byref(panel))
    nk = -(-Nk // panel.value) * panel.value
    return (nk * d,), (nk * (-(-d // width.value) * width.value),)


TASK_ROWS = 384
"""Q rows per task (four of the kernel's 96-row tiles): short enough that causal
calls, whose bottom rows see the most keys, spread evenly over the threads."""


def forward(q4, k3, v3, causal, scale, workers, isa="auto"):
    """o (BH, G, Nq, d) and lse (BH, G, Nq), float32, from q4 (BH, G, Nq, d) and
    k3, v3 (BH, Nk, d) of any float dtype (widened to float32); None when the
    library is not available or some row came out NaN or +inf — inputs that are not
    finite, or a score or P̃ V past float32's range — for the NumPy forward to redo
    with its handling of those. A row's result does not depend on the tasks: its key
    tiles start at key 0 in steps of 512 whichever rows share its tile, and a key
    tile wholly hidden from it adds exact zeros."""
    lib, _ = library(isa)
    if lib is None:
        return None
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    q4, k3, v3 = (np.ascontiguousarray(x, dtype=np.float32) for x in (q4, k3, v3))
    o = np.empty((BH, G, Nq, d), np.float32)
    lse = np.empty((BH, G, Nq), np.float32)
    kp_shape, vp_shape = packed_shapes(lib, Nk, d)
    buf, (Kp, Vp) = CALL_BUFFERS.take(((BH, *kp_shape), np.float32),
                                      ((BH, *vp_shape), np.float32))
    packed = Once(lambda h: lib.cuflash_pack_kv(k3[h], v3[h], Nk, d, Kp[h], Vp[h]))
    c = np.float32(scale * np.log2(np.e))
    diag = Nk - Nq

    def keys_seen(r1):  # by the task's last row, which sees the most
        return min(Nk, max(0, r1 + diag)) if causal else Nk

    # Biggest first; among equals, one head after another, so that the threads'
    # first tasks pack different heads rather than wait on one.
    tasks = [(h, r0, min(r0 + TASK_ROWS, Nq)) for r0 in range(0, Nq, TASK_ROWS)
             for h in range(BH)]
    tasks.sort(key=lambda t: -(t[2] - t[1]) * keys_seen(t[2]))

    def run(task):
        h, r0, r1 = task
        packed(h)
        return lib.cuflash_forward_rows(q4[h], Kp[h], Vp[h], o[h], lse[h], G, Nq, Nk, d,
                                        r0, r1, c, int(causal))

    bad = sum(run_tasks(run, tasks, workers))
    CALL_BUFFERS.give_back(buf)
    return None if bad else (o, lse)
