"""The compiled CPU kernels: FA2's forward and backward for float32 on x86 CPUs with
AVX-512 or AVX2, in C++ (`flash_fwd_cpu.cpp`, `flash_bwd_cpu.cpp`, sharing
`cpu_simd.h`), built by the host's C++ compiler on first use.

Each thread runs whole tiles — Q Kᵀ, the softmax and P̃ V in the forward, the five
products of the backward — on score tiles that stay in the core's caches, with
register-blocked vector loops, where the NumPy tiles call OpenBLAS and NumPy's ufuncs
once per step (`forward.py`, `backward.py`). The NumPy tiles stay the path for
float64, for the variants, for FA1's order, and wherever the kernels are not
available: no AVX2 with FMA, no compiler, a failed build (`library` says why).

The sources are built once per instruction set (`ISAS`) into one library;
`CpuConfig.native` picks one or "auto", the widest this CPU has. The library is built
with `$CXX` (else g++) into cuflash's cache (`compiler.cache_dir("cpu")`), keyed by
the sources, the flags and the compiler's version, and loaded with ctypes, which lets
go of the GIL for the call.
"""
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .... import compiler
from ..arrays import CALL_BUFFERS
from ..expbase import numpy_dispatch
from ..pool import Once, lanes, run_tasks

HERE = Path(__file__).parent
SOURCES = (HERE / "flash_fwd_cpu.cpp", HERE / "flash_bwd_cpu.cpp")
HEADERS = (HERE / "cpu_simd.h",)
ISAS = {  # name: (the CPU features it needs, as NumPy names them; its compiler flags)
    "avx512": (("AVX512F", "FMA3"), ("-DCUFLASH_AVX512", "-mavx512f", "-mfma")),
    "avx2": (("AVX2", "FMA3"), ("-DCUFLASH_AVX2", "-mavx2", "-mfma")),
}
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-w")
CHOICES = ("auto", *ISAS, "off")
"""CpuConfig.native's values: the widest instruction set this CPU has, one by name, or
the NumPy tiles always."""

_p = ctypes.c_void_p  # a head's float32 array: `heads` gives the addresses
_i = ctypes.c_int


def heads(x):
    """The address of x[h] for each h, x contiguous float32: ctypes takes an int as a
    pointer without numpy.ctypeslib's per-call checks (~1.5 µs an array: 0.2 ms of a
    0.6 ms backward at N = 64)."""
    assert x.dtype == np.float32 and x.flags.c_contiguous
    base, step = x.ctypes.data, x.strides[0]
    return [base + h * step for h in range(x.shape[0])]


def best_isa():
    """The widest of ISAS this CPU has (NumPy's reading of it, the OS saving the
    registers), or None."""
    features = numpy_dispatch()[1]
    return next((isa for isa, (needs, _) in ISAS.items()
                 if all(features.get(f) for f in needs)), None)


def build(native):
    """The build a CpuConfig.native setting asks for: `best_isa()` for "auto"."""
    return best_isa() if native == "auto" else native


def library(native="auto"):
    """(the loaded library of the build `native` asks for, None) or (None, why there is
    none)."""
    isa = build(native)
    if isa == "off":
        return None, "CpuConfig.native is 'off'"
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
    name, cxx = compiler.host_cxx()
    if cxx is None:
        return None, f"no C++ compiler ({name!r} is not on PATH)"
    missing = [f.name for f in SOURCES + HEADERS if not f.is_file()]
    if missing:
        return None, f"the kernel sources {', '.join(missing)} are missing from {HERE}"
    flags = (*FLAGS, *isa_flags)
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (*flags, cxx, compiler.host_cxx_version(cxx)):
        h.update(part.encode() + b"\0")
    cache = compiler.cache_dir("cpu")
    so = cache / f"flash_cpu_{isa}-{h.hexdigest()[:24]}.so"
    if not so.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                out = Path(tmp) / "lib.so"
                r = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", str(out)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    return None, f"{cxx} failed on the CPU kernels ({isa}):\n{r.stderr.strip()}"
                os.replace(out, so)  # atomic: concurrent processes share the cache
        except OSError as e:  # a cache that cannot be written
            return None, f"could not build into {cache}: {e}"
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:  # e.g. a cache on a noexec mount
        return None, f"could not load {so}: {e}"
    lib.cuflash_layout.argtypes = [ctypes.POINTER(_i), ctypes.POINTER(_i)]
    lib.cuflash_layout.restype = None
    for name in ("cuflash_pack_panels", "cuflash_pack_rows"):
        getattr(lib, name).argtypes = [_p, _i, _i, _p]
        getattr(lib, name).restype = None
    lib.cuflash_forward_rows.argtypes = [_p, _p, _p, _p, _p,
                                         _i, _i, _i, _i, _i, _i, ctypes.c_float, _i]
    lib.cuflash_forward_rows.restype = _i
    lib.cuflash_backward_keys.argtypes = [_p] * 10 + [_i] * 6 + [ctypes.c_float] * 2 + [_i]
    lib.cuflash_backward_keys.restype = None
    lib.cuflash_backward_task_keys.restype = _i
    return lib, None


def packed_sizes(lib, N, d):
    """Floats of one head's x (N, d) packed as panels and as rows (cpu_simd.h)."""
    width, panel = _i(), _i()
    lib.cuflash_layout(ctypes.byref(width), ctypes.byref(panel))
    n = -(-N // panel.value) * panel.value
    return n * d, n * (-(-d // width.value) * width.value)


TASK_ROWS = 384
"""Q rows per task (four of the kernel's 96-row tiles): short enough that causal
calls, whose bottom rows see the most keys, spread evenly over the threads."""


def forward(q4, k3, v3, causal, scale, workers, native="auto"):
    """o (BH, G, Nq, d) and lse (BH, G, Nq), float32, from q4 (BH, G, Nq, d) and
    k3, v3 (BH, Nk, d) of any float dtype (widened to float32); None when the
    library is not available or some row came out NaN or +inf — inputs that are not
    finite, or a score or P̃ V past float32's range — for the NumPy forward to redo
    with its handling of those. A row's result does not depend on the tasks: its key
    tiles start at key 0 in steps of 512 whichever rows share its tile, and a key
    tile wholly hidden from it adds exact zeros."""
    lib, _ = library(native)
    if lib is None:
        return None
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    q4, k3, v3 = (np.ascontiguousarray(x, dtype=np.float32) for x in (q4, k3, v3))
    o = np.empty((BH, G, Nq, d), np.float32)
    lse = np.empty((BH, G, Nq), np.float32)
    panels, rows = packed_sizes(lib, Nk, d)
    buf, (Kp, Vp) = CALL_BUFFERS.take(((BH, panels), np.float32), ((BH, rows), np.float32))

    k_, v_, Kp_, Vp_, q_, o_, lse_ = map(heads, (k3, v3, Kp, Vp, q4, o, lse))

    def pack(h):
        lib.cuflash_pack_panels(k_[h], Nk, d, Kp_[h])
        lib.cuflash_pack_rows(v_[h], Nk, d, Vp_[h])
    packed = Once(pack)
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
        return lib.cuflash_forward_rows(q_[h], Kp_[h], Vp_[h], o_[h], lse_[h], G, Nq, Nk, d,
                                        r0, r1, c, int(causal))

    bad = sum(run_tasks(run, tasks, workers))
    CALL_BUFFERS.give_back(buf)
    return None if bad else (o, lse)


def backward(do, q4, k3, v3, o, lse, causal, scale, workers, native="auto"):
    """dq (BH, G, Nq, d), dk, dv (BH, Nk, d), float32, from q4, do, o (BH, G, Nq, d),
    k3, v3 (BH, Nk, d) and lse (BH, G, Nq) of any float dtype; None when the library
    is not available or a gradient came out NaN or ±inf (inputs that are not finite, an
    lse that is not the forward's), for the NumPy backward to redo.

    Each task is one K/V tile of a head (384 keys: `cuflash_backward_task_keys`), over
    every row that sees it (the NumPy backward's order). The tasks run in fixed lanes (`pool.lanes`), each lane adding
    its dQ terms into an accumulator of its own in task order, and the lanes' sums
    are added in lane order: the result depends on the inputs and the worker count
    only."""
    lib, _ = library(native)
    if lib is None:
        return None
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    f32 = np.float32
    q4, do, k3, v3 = (np.ascontiguousarray(x, dtype=f32) for x in (q4, do, k3, v3))
    # L2 = lse·log2(e), +inf where lse = −inf (the row saw no key: P = 0, so that its dS
    # is 0 whatever D is); D = rowsum(dO ∘ O)
    lse = np.asarray(lse, f32)
    L2 = np.where(lse == -np.inf, np.inf, lse * f32(np.log2(np.e))).astype(f32)
    D = np.einsum("...i,...i->...", do, o.astype(f32, copy=False), dtype=f32)
    panels, rows = packed_sizes(lib, Nk, d)
    buf, (Kp, Vt, Kr) = CALL_BUFFERS.take(((BH, panels), f32), ((BH, panels), f32),
                                          ((BH, rows), f32))

    dk = np.empty((BH, Nk, d), f32)
    dv = np.empty((BH, Nk, d), f32)
    q_, do_, L2_, D_, k_, v_, Kp_, Vt_, Kr_, dk_, dv_ = map(
        heads, (q4, do, L2, D, k3, v3, Kp, Vt, Kr, dk, dv))

    def pack(h):
        lib.cuflash_pack_panels(k_[h], Nk, d, Kp_[h])
        lib.cuflash_pack_panels(v_[h], Nk, d, Vt_[h])
        lib.cuflash_pack_rows(k_[h], Nk, d, Kr_[h])
    packed = Once(pack)
    c = f32(scale * np.log2(np.e))
    diag = Nk - Nq

    def rows_seeing(c0):  # causal: row r sees key c0 from r = c0 − diag on
        return Nq - min(Nq, max(0, c0 - diag)) if causal else Nq

    keys = lib.cuflash_backward_task_keys()
    tasks = [(h, c0, min(c0 + keys, Nk)) for c0 in range(0, Nk, keys) for h in range(BH)]

    def run_lane(lane):
        dq = np.zeros((BH, G, Nq, d), f32)
        dq_ = heads(dq)
        for h, c0, c1 in lane:
            packed(h)
            lib.cuflash_backward_keys(q_[h], do_[h], L2_[h], D_[h], Kp_[h], Vt_[h], Kr_[h],
                                      dq_[h], dk_[h], dv_[h], G, Nq, Nk, d, c0, c1, c, scale,
                                      int(causal))
        return dq

    cost = lambda t: (t[2] - t[1]) * rows_seeing(t[1])
    parts = run_tasks(run_lane, lanes(tasks, workers, cost), workers)
    CALL_BUFFERS.give_back(buf)
    dq = parts[0]
    for part in parts[1:]:                                      # in lane order
        dq += part
    dq *= f32(scale)
    if not all(np.isfinite(x).all() for x in (dq, dk, dv)):
        return None
    return dq, dk, dv
