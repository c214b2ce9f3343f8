"""What a CPU benchmark ran on: the CPU's model and SIMD flags, and the BLAS kernels
NumPy runs (OpenBLAS picks them from the CPU when it loads, unless OPENBLAS_CORETYPE
names them: on one AVX-512 Zen 5, float32 GEMM ran at 123 GFLOP/s per core with the
Haswell (AVX2) kernels and 232 with SkylakeX's). Every CPU ratio depends on both."""
import ctypes
import os
import platform
import time

import numpy as np

_SIMD = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
         "avx512_fp16", "amx_tile", "neon", "asimd", "sve")
# Variables that cap the instruction sets NumPy's loops, PyTorch's kernels and MKL use
# below what the CPU has: a run under them is named so.
_CAPS = ("NPY_DISABLE_CPU_FEATURES", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def machine():
    """{cpu, simd, blas}: the CPU's model and SIMD flags (/proc/cpuinfo, with the caps of
    _CAPS that are set), and the BLAS NumPy runs with the kernels it picked (OpenBLAS's
    core) and OPENBLAS_CORETYPE."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name") and model == platform.machine():
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    blas = "?"
    try:
        dep = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{dep.get('name', '?')} {dep.get('version', '')}".strip()
    except Exception:  # older NumPy: no dicts
        pass
    core = openblas_core()
    if core:
        blas += f", core {core}"
    if "OPENBLAS_CORETYPE" in os.environ:
        blas += f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
    simd = " ".join(f for f in _SIMD if f in flags) or "?"
    caps = [f"{v}={os.environ[v]}" for v in _CAPS if v in os.environ]
    if caps:
        simd += f" (capped: {', '.join(caps)})"
    return {"cpu": model, "simd": simd, "blas": blas, "exp": exp_speed()}


def exp_speed():
    """ns per float32 of NumPy's exp2 and exp in this process, e.g. "exp2 0.20 ns, exp
    0.31 ns": the NumPy tiles' one elementwise pass over every score tile runs one of
    them (CpuConfig.base); the compiled kernels have their own. On one Zen 5 virtual machine, NumPy 2.4's AVX-512 float32 exp2 ran
    at 0.18 ns in most processes and at 0.6 ns in 14 of 58: in the 6 of those where it
    was printed, the ones whose _multiarray_umath code was loaded at an address ≡ 0xc2b000
    mod 16 MiB (in none of 20 with address randomisation off); exp ran at 0.32 ns in all.
    In such a process the forward reads ~15% slower against PyTorch."""
    x = np.linspace(-20, 0, 1 << 18, dtype=np.float32)
    out = np.empty_like(x)
    speeds = []
    for fn in (np.exp2, np.exp):
        fn(x, out=out)
        best = min(_seconds(lambda: fn(x, out=out)) for _ in range(15))
        speeds.append(f"{fn.__name__} {best / x.size * 1e9:.2f} ns")
    return ", ".join(speeds)


def _seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def openblas_core():
    """The kernels (core name) of the OpenBLAS loaded in this process, or ''."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return ""
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("openblas_get_corename", "scipy_openblas_get_corename64_",
                     "scipy_openblas_get_corename"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return ""
