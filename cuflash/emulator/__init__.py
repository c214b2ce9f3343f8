"""CPU emulator for CUDA C kernels: a drop-in for ``cupy.RawModule`` on NumPy arrays.

The unchanged ``.cu`` source is compiled by g++ as C++ with a force-included shim header;
every CUDA thread runs as a fiber, blocks run one after another (or on a small worker pool).
``checked=True`` (or ``CUFLASH_EMULATOR_CHECKED=1`` at launch time) instruments every memory
access to find shared-memory races, inter-block global races and out-of-bounds accesses.
Inline PTX (mma.sync, ldmatrix, cp.async, cvt, ex2, and on sm_90a wgmma) runs with the ISA's
semantics and the emulated GPU's tensor-core arithmetic; :mod:`.archs` holds each emulated GPU's limits.
:func:`availability` says whether g++ and the CUDA headers are here, or what to install.
A long launch stops at Ctrl-C (KeyboardInterrupt). See ``docs/emulator.md``.
"""
from . import tma
from ._build import availability
from ._errors import (AsyncHazardError, BoundsError, DeadlockError, EmulatorCompileError, EmulatorError,
                      KernelFault, KernelTrap, RaceError)
from ._module import RawKernel, RawModule, context_switch_ns
from .archs import ARCHS, Arch, GpuLimits, TensorCoreArithmetic, get_arch, gpu_limits

__all__ = ["RawModule", "RawKernel", "EmulatorError", "EmulatorCompileError", "RaceError", "AsyncHazardError",
           "BoundsError", "DeadlockError", "KernelTrap", "KernelFault", "availability", "context_switch_ns", "ARCHS", "Arch",
           "GpuLimits", "TensorCoreArithmetic", "get_arch", "gpu_limits", "tma"]
