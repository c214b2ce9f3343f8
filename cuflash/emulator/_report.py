"""The runtime's error record of a failed launch, turned into the exception a user reads:
what happened, to which variable or argument, by which thread, at which source line."""
from __future__ import annotations

import numpy as np

from ._abi import ErrorKind, ErrorRecord, Space
from ._errors import AsyncHazardError, BoundsError, DeadlockError, EmulatorError, KernelFault, KernelTrap, RaceError
from ._library import Library


def _fmt3(v) -> str:
    return f"({v[0]},{v[1]},{v[2]})"


def launch_error(err: ErrorRecord, lib: Library, kname: str, args) -> EmulatorError:
    """The exception for `err`, raised by a launch of kernel `kname` with `args`."""
    kind = ErrorKind(err.code)
    msg = err.msg.decode(errors="replace").rstrip()
    who = f"thread {_fmt3(err.thread)} of block {_fmt3(err.block)}"
    if kind == ErrorKind.RACE:
        return RaceError(f"{kname}: {_race(err, lib, args, who, msg)}")
    if kind == ErrorKind.HAZARD:
        at = f" at {lib.where(err.pc)}" if err.pc else ""
        rw = "writes" if err.is_write else "reads"
        access = f" {rw} {err.size} byte(s){at}" if err.size else at
        return AsyncHazardError(f"{kname}: {who}{access}: {msg}")
    if kind == ErrorKind.BOUNDS and err.space == Space.NONE:   # found by an inline-PTX instruction
        return BoundsError(f"{kname}: {who}: {msg}")
    if kind == ErrorKind.BOUNDS:
        return BoundsError(f"{kname}: {_bounds(err, lib, args, who)}")
    if kind == ErrorKind.DEADLOCK:
        if err.pc and err.other_pc:   # two lanes at different sites of an .aligned instruction
            sites = [lib.call_site(err.pc), lib.call_site(err.other_pc)]
            if all(sites):
                msg += (f"; thread {_fmt3(err.thread)} is at {sites[0]}; thread {_fmt3(err.other_thread)} "
                        f"is at {sites[1]}")
        return DeadlockError(f"{kname}: {msg}")
    if kind == ErrorKind.TRAP:
        return KernelTrap(f"{kname}: {who}: {msg}")
    if kind == ErrorKind.FAULT:
        return KernelFault(f"{kname}: {who}: {msg}")
    return EmulatorError(f"{kname}: {msg or 'launch failed'}")


def _shared_name(err: ErrorRecord, lib: Library) -> str:
    return lib.shared_name(err.space == Space.SHARED_DYNAMIC, err.offset)


def _race(err: ErrorRecord, lib: Library, args, who: str, msg: str) -> str:
    rw = "writes" if err.is_write else "reads"
    prev = "wrote" if err.other_is_write else "read"
    ow = f"thread {_fmt3(err.other_thread)}" if err.other_thread[0] >= 0 else "other threads"
    if msg:   # an access to the destination of a cp.async in flight (msg names it)
        return (f"shared-memory race on {_shared_name(err, lib)}: {who} {rw} {err.size} byte(s) at "
                f"{lib.where(err.pc)} while {msg}")
    if err.space != Space.GLOBAL:
        return (f"shared-memory race on {_shared_name(err, lib)}: {who} {rw} {err.size} byte(s) at "
                f"{lib.where(err.pc)}; {ow} {prev} it at {lib.where(err.other_pc)} with no __syncthreads() "
                "in between")
    ai = err.arg_index
    arr = args[ai] if 0 <= ai < len(args) else None
    desc = (f"argument {ai} ({arr.dtype}[{arr.size}]) at byte offset {err.offset}" if arr is not None
            else f"address {err.addr:#x}")
    if err.other_thread[0] >= 0 or (err.other_pc and tuple(err.other_block) == tuple(err.block)):
        return (f"global-memory race between threads of one block on {desc}: {who} {rw} {err.size} byte(s) at "
                f"{lib.where(err.pc)}; {ow} {prev} it at {lib.where(err.other_pc)} with no __syncthreads() "
                "in between")
    return (f"inter-block race on global memory {desc}: {who} {rw} {err.size} byte(s) at {lib.where(err.pc)}, "
            f"but block {_fmt3(err.other_block)} already {prev} it in this launch "
            "(blocks run in any order on a GPU)")


def _bounds(err: ErrorRecord, lib: Library, args, who: str) -> str:
    rw = "write" if err.is_write else "read"
    if err.space != Space.GLOBAL:
        return (f"out-of-bounds shared-memory {rw} of {err.size} byte(s) on {_shared_name(err, lib)} by {who} at "
                f"{lib.where(err.pc)}: beyond the launch's shared memory")
    ai = err.arg_index
    near = ""
    if 0 <= ai < len(args) and isinstance(args[ai], np.ndarray):
        a = args[ai]
        nb = a.size * a.itemsize
        off = err.offset
        rel = (f"{-off} bytes before its start" if off < 0 else f"{off - nb} bytes past its end"
               if off >= nb else f"at byte offset {off}")
        near = f"; nearest array is argument {ai} ({a.dtype}{list(a.shape)}, {nb} bytes), the access is {rel}"
    return (f"out-of-bounds global {rw} of {err.size} byte(s) at address {err.addr:#x} by {who} at "
            f"{lib.where(err.pc)}: not inside any array argument{near}")
