"""RawModule / RawKernel: CuPy's interface to emulated kernels, and their launch."""
from __future__ import annotations

import ctypes
import os
import re
import threading
from pathlib import Path

import numpy as np

from . import tma
from ._abi import ErrorRecord, ParamKind, Schedule
from ._build import build
from ._errors import EmulatorCompileError, EmulatorError
from ._library import Library
from ._report import launch_error
from .archs import get_arch

_DEFAULT_SMEM = 48 * 1024   # static + dynamic shared memory a kernel may use without opting in
_WAIT_MS = 50               # how long a launch waits for its workers between checks for Ctrl-C


def _dim3(v, what: str) -> tuple:
    if isinstance(v, (int, np.integer)):
        v = (int(v),)
    try:
        t = tuple(int(x) for x in v)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of up to 3 ints, got {v!r}") from None
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    t = t + (1,) * (3 - len(t))
    if any(x < 1 for x in t):
        raise ValueError(f"{what} dimensions must be >= 1, got {v!r}")
    return t


def _checked_from_env() -> bool:
    return os.environ.get("CUFLASH_EMULATOR_CHECKED", "").strip().lower() not in ("", "0", "false", "no", "off")


def _workers() -> int:
    env = os.environ.get("CUFLASH_EMULATOR_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


class RawModule:
    """Drop-in for ``cupy.RawModule`` running the kernels on the CPU on NumPy arrays.

    ``code`` is CUDA C source (or ``path`` a ``.cu`` file); ``options`` the NVRTC option tuple
    (``-I``, ``-D``, ``-std`` are honoured, GPU-only ones ignored); ``name_expressions`` the
    kernel names/template instantiations to build. ``checked=True`` (or ``CUFLASH_EMULATOR_CHECKED=1``)
    runs launches with race and bounds checking; ``schedule`` picks the thread order inside a block
    ("round-robin", "reversed", "random" with ``seed``). ``arch`` is the emulated GPU ("sm_75" ...
    "sm_90"; default ``$CUFLASH_EMULATOR_ARCH``, else "sm_80"): it sets ``__CUDA_ARCH__``, decides
    which inline PTX compiles and how ``mma.sync`` rounds (:mod:`cuflash.emulator.archs`).
    """

    def __init__(self, code=None, path=None, options=(), name_expressions=(), checked=False,
                 schedule="round-robin", seed=0, arch=None):
        if (code is None) == (path is None):
            raise TypeError("RawModule needs exactly one of code= or path=")
        if path is not None:
            path = os.fspath(path)
            try:
                code = Path(path).read_text()
            except OSError as e:
                raise EmulatorError(f"cannot read kernel source {path!r}: {e}") from None
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of CUDA C source, got {type(code).__name__}")
        if isinstance(options, str):
            options = (options,)
        self.code = code
        self.path = path
        self.options = tuple(options or ())
        self.name_expressions = [str(n) for n in (name_expressions or ())]
        self.checked = bool(checked)
        self.schedule = Schedule.from_name(schedule)
        self.seed = int(seed)
        self.arch = get_arch(arch)
        self._extra = []
        self._libs = {}
        self._mlock = threading.RLock()

    def _names(self) -> list:
        names = list(self.name_expressions)
        names += [n for n in self._extra if n not in names]
        return names

    def _library(self, checked: bool) -> Library:
        with self._mlock:
            names = self._names()
            lib = self._libs.get(checked)
            if lib is not None and all(n in lib.names for n in names):
                return lib
            # like one NVRTC program: build every extern "C" kernel of the source at once, so that
            # further get_function() calls need no new compile; fall back to the requested names
            auto = [n for n in _extern_c_kernels(self.code) if n not in names]
            if auto and self._extra:
                try:
                    lib = build(self.code, self.path, self.options, names + auto, checked, self.arch)
                except EmulatorCompileError:
                    lib = build(self.code, self.path, self.options, names, checked, self.arch)
            else:
                lib = build(self.code, self.path, self.options, names, checked, self.arch)
            self._libs[checked] = lib
            return lib

    def compile(self, checked=None):
        """Compile now (normally done lazily at the first launch)."""
        self._library(self.checked if checked is None else bool(checked))
        return self

    def get_function(self, name: str) -> "RawKernel":
        name = str(name)
        with self._mlock:
            if name not in self.name_expressions and name not in self._extra:
                self._extra.append(name)
        k = RawKernel(self, name)
        # compile eagerly in the mode the module was created for, like cupy does at get_function
        try:
            k._lib(self.checked or _checked_from_env())
        except EmulatorCompileError as e:
            with self._mlock:
                if name in self._extra:
                    self._extra.remove(name)
            if "launcher.cpp" in str(e) and f"&{name}" in str(e):
                raise EmulatorCompileError(
                    f"kernel {name!r} not found: it does not name a __global__ function (or template "
                    f"instantiation) of the source.\n\n{e}") from None
            raise
        return k

    get_kernel = get_function


class RawKernel:
    """A kernel of an emulated module; call it like ``cupy.RawKernel``: ``k(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: RawModule, name: str):
        self.module = module
        self.name = name
        self._max_dynamic_smem = None   # CUDA's default: 48 KiB less the static arrays
        # checked mode: {argument index: (bytes read, bytes written)} of the last launch's
        # global accesses to each array argument (cp.async and TMA copies included)
        self.last_traffic = None
        self.preferred_shared_memory_carveout = -1
        self.attributes = {}

    # CuPy exposes these read-only attributes; plausible values for an emulated device
    max_threads_per_block = 1024
    num_regs = 0
    local_size_bytes = 0

    @property
    def shared_size_bytes(self) -> int:
        """The static __shared__ bytes: those of every kernel in the module (exact for a
        module of one kernel, else an upper bound: a device function's arrays belong to
        whichever kernels call it, which the library does not record)."""
        lib, _ = self._lib(self.module.checked or _checked_from_env())
        total = sum(size for _, size, _ in lib.static_shared)
        return -(-total // 16) * 16   # ptxas reserves static shared memory in 16-byte units

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """The most dynamic shared memory a launch may ask for: as on CUDA, 48 KiB less the
        static arrays until raised, at most the arch's opt-in limit less them."""
        if self._max_dynamic_smem is None:
            return _DEFAULT_SMEM - self.shared_size_bytes
        return self._max_dynamic_smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        value = int(value)
        static = self.shared_size_bytes
        most = self.module.arch.limits.shared_per_block_optin - static
        if not 0 <= value <= most:
            raise ValueError(
                f"max_dynamic_shared_size_bytes of {self.name} must be in [0, {most}] on "
                f"{self.module.arch.name} ({self.module.arch.limits.shared_per_block_optin} "
                f"bytes per block less {static} of static arrays), got {value} (a GPU "
                "refuses it too)")
        self._max_dynamic_smem = value

    def _lib(self, checked: bool):
        lib = self.module._library(checked)
        return lib, lib.names.index(self.name)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise EmulatorError("cooperative launches are not supported by the CPU emulator")
        g, b, shared_mem = self._launch_shape(grid, block, shared_mem)
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of arrays and NumPy scalars, got {type(args).__name__}")
        checked = self.module.checked or _checked_from_env()
        lib, k = self._lib(checked)
        holders, ranges = self._marshal(args, lib.params[k])
        argv = (ctypes.c_void_p * max(1, len(holders)))(
            *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in holders))
        rarr = (ctypes.c_ulonglong * max(1, len(ranges)))(*ranges)
        err = ErrorRecord()
        rt = lib.runtime
        with lib.launch_lock:
            finished = False
            try:
                rt.launch_start(k, (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, argv,
                                len(ranges) // 3, rarr, int(checked), self.module.schedule, self.module.seed,
                                1 if checked else _workers())
                # worker threads run the blocks; waiting in short slices lets Python run its signal
                # handlers, so Ctrl-C (KeyboardInterrupt) stops a long launch
                while not rt.launch_wait(_WAIT_MS):
                    pass
                finished = True
                if checked:
                    n = len(ranges) // 3
                    out = (ctypes.c_uint64 * max(1, 3 * n))()
                    rt.launch_traffic(out, n)
                    self.last_traffic = {int(out[3 * i]): (int(out[3 * i + 1]), int(out[3 * i + 2]))
                                         for i in range(n)}
            finally:
                # an exception (Ctrl-C) cancels the launch: the workers stop at their next
                # barrier, warp operation or block, and the arrays are free again on return
                code = rt.launch_end(int(not finished), ctypes.byref(err))
        if code:
            raise launch_error(err, lib, self.name, args)

    def _launch_shape(self, grid, block, shared_mem) -> tuple:
        """grid and block as 3-tuples and shared_mem as an int, checked against CUDA's limits."""
        g = _dim3(grid, "grid")
        b = _dim3(block, "block")
        nthreads = b[0] * b[1] * b[2]
        if nthreads > 1024:
            raise ValueError(f"block {block!r} has {nthreads} threads; CUDA allows at most 1024 per block")
        if b[2] > 64:
            raise ValueError(f"block z dimension {b[2]} exceeds CUDA's limit of 64")
        if g[1] > 65535 or g[2] > 65535:
            raise ValueError(f"grid {grid!r}: y and z dimensions must be <= 65535")
        shared_mem = int(shared_mem)
        if shared_mem < 0:
            raise ValueError(f"shared_mem must be >= 0, got {shared_mem}")
        allowed = self.max_dynamic_shared_size_bytes
        if shared_mem > allowed:
            raise ValueError(
                f"launch of {self.name} asks for {shared_mem} bytes of dynamic shared memory but the kernel's "
                f"max_dynamic_shared_size_bytes is {allowed} (its static arrays take "
                f"{self.shared_size_bytes}); set kernel.max_dynamic_shared_size_bytes = {shared_mem} "
                "first (a GPU launch would fail too)")
        return g, b, shared_mem

    def _marshal(self, args, params) -> tuple:
        """(one ctypes holder per argument, [lo, size, index] of every array argument), after
        checking each argument against the kernel's parameter list (CuPy would pass wrong bytes)."""
        if len(args) != len(params):
            raise TypeError(f"kernel {self.name} takes {len(params)} arguments, got {len(args)}")
        holders, ranges = [], []
        for i, (a, (size, kind)) in enumerate(zip(args, params)):
            where = f"argument {i} of {self.name}"
            if isinstance(a, np.ndarray):
                if kind != ParamKind.POINTER:
                    raise TypeError(f"{where}: got a NumPy array but the kernel parameter is a "
                                    f"{size}-byte {kind.description} passed by value")
                lo, hi = _extent(a)
                ranges += [lo, hi - lo, i]
                holders.append(ctypes.c_void_p(a.__array_interface__["data"][0]))
            elif a is None:  # CuPy passes None as a null pointer
                if kind != ParamKind.POINTER:
                    raise TypeError(f"{where}: got None but the kernel parameter is a "
                                    f"{size}-byte {kind.description} passed by value")
                holders.append(ctypes.c_void_p(0))
            elif hasattr(a, "__cuda_array_interface__"):
                raise TypeError(f"{where}: a GPU array ({type(a).__name__}) cannot be used by the CPU emulator; "
                                "pass a NumPy array")
            elif isinstance(a, np.generic):
                if kind == ParamKind.POINTER:
                    raise TypeError(f"{where}: the kernel parameter is a pointer but got a scalar {a.dtype}; "
                                    "pass a NumPy array")
                if a.dtype.itemsize != size:
                    raise TypeError(f"{where}: the kernel parameter is a {size}-byte {kind.description}, "
                                    f"got {a.dtype} ({a.dtype.itemsize} bytes)")
                if kind == ParamKind.FLOAT and a.dtype.kind != "f":
                    raise TypeError(f"{where}: the kernel parameter is floating-point, got {a.dtype}")
                if kind in (ParamKind.SIGNED, ParamKind.UNSIGNED) and a.dtype.kind not in "iub":
                    raise TypeError(f"{where}: the kernel parameter is an integer, got {a.dtype}")
                holders.append(ctypes.create_string_buffer(a.tobytes(), max(size, 1)))
                span = tma.extent(a.tobytes()) if kind == ParamKind.RECORD else None
                if span:   # a tensor map: its tensor is an array the kernel reads and writes
                    ranges += [span[0], span[1], i]
            elif isinstance(a, (bool, int, float, complex)):
                raise TypeError(f"{where}: Python {type(a).__name__} {a!r} has no fixed C type; wrap it in a NumPy "
                                "scalar of the kernel's parameter type (e.g. numpy.int32(n), numpy.float32(x))")
            else:
                raise TypeError(f"{where}: unsupported type {type(a).__name__}; pass NumPy arrays and NumPy scalars")
        return holders, ranges


_EXTERN_C_RE = re.compile(r'extern\s+"C"\s+(?:__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void'
                          r'|void\s+__global__)\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\(')


def _extern_c_kernels(code: str) -> list:
    """Names of `extern "C" __global__ void name(` kernels (plain identifiers, buildable by name)."""
    stripped = re.sub(r"//[^\n]*|/\*.*?\*/", " ", code, flags=re.S)
    stripped = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", stripped, flags=re.M)   # macro bodies are no kernels
    out = []
    for n in _EXTERN_C_RE.findall(stripped):
        if n not in out:
            out.append(n)
    return out


def _extent(a: np.ndarray) -> tuple:
    """[lo, hi) byte range an array (possibly a strided view) can touch."""
    ptr = a.__array_interface__["data"][0]
    if a.size == 0:
        return ptr, ptr
    lo = hi = ptr
    for n, s in zip(a.shape, a.strides):
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + a.itemsize


def context_switch_ns(iterations: int = 1_000_000) -> float:
    """Measured cost of one fiber context switch, in nanoseconds (-1 where not x86-64)."""
    lib = build('extern "C" __global__ void __emu_noop() {}', None, (), ["__emu_noop"], False, get_arch())
    return float(lib.runtime.bench_switch(int(iterations)))
