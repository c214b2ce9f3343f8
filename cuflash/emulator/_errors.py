"""Exceptions raised by the CPU emulator."""


class EmulatorError(RuntimeError):
    """Base class of every error raised by :mod:`cuflash.emulator`."""


class EmulatorCompileError(EmulatorError):
    """The kernel source did not compile as host C++ (message holds g++'s diagnostics)."""


class RaceError(EmulatorError):
    """Checked mode found a data race (shared memory within a block, or global memory between blocks)."""


class AsyncHazardError(RaceError):
    """Checked mode found an operand of an asynchronous operation (``wgmma.mma_async``, a bulk or
    tensor copy) touched before the operation completed, or an mbarrier misused."""


class BoundsError(EmulatorError):
    """Checked mode found an access outside the launch's arrays or its dynamic shared memory."""


class DeadlockError(EmulatorError):
    """No thread of a block can make progress (barrier / warp-primitive mismatch)."""


class KernelTrap(EmulatorError):
    """Device code called ``__trap()`` or a device ``assert`` failed."""


class KernelFault(EmulatorError):
    """Device code dereferenced an invalid address (segmentation fault) or overflowed its stack."""
