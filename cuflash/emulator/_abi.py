"""The C interface of an emulator library, mirrored from ``runtime/abi.h``: the enums, the
error record and the signatures of the runtime's exported functions.

tests/test_emulator.py checks the enums against abi.h; a library refuses to load when its
error record's size differs from :class:`ErrorRecord`'s.
"""
from __future__ import annotations

import ctypes
import enum


class ErrorKind(enum.IntEnum):
    """EmuErrorKind: what ended a launch."""
    NONE = 0
    GENERIC = 1
    RACE = 2
    BOUNDS = 3
    DEADLOCK = 4
    TRAP = 5
    FAULT = 6
    HAZARD = 7


class Space(enum.IntEnum):
    """EmuSpace: the memory an offending access touched."""
    NONE = 0
    SHARED_STATIC = 1
    SHARED_DYNAMIC = 2
    GLOBAL = 3


class Schedule(enum.IntEnum):
    """EmuSchedule: the order in which a block's runnable threads are resumed."""
    ROUND_ROBIN = 0
    REVERSED = 1
    RANDOM = 2

    @classmethod
    def from_name(cls, name: str) -> "Schedule":
        """"round-robin", "reversed" or "random" (the names RawModule takes)."""
        try:
            return cls[name.upper().replace("-", "_")]
        except (KeyError, AttributeError):
            raise ValueError(f"schedule must be one of {SCHEDULE_NAMES}, got {name!r}") from None


SCHEDULE_NAMES = tuple(s.name.lower().replace("_", "-") for s in Schedule)


class ParamKind(enum.IntEnum):
    """EmuParamKind: how a kernel parameter is passed."""
    POINTER = 1
    FLOAT = 2
    SIGNED = 3
    UNSIGNED = 4
    RECORD = 5

    @property
    def description(self) -> str:
        return {"POINTER": "pointer", "FLOAT": "floating-point", "SIGNED": "signed integer",
                "UNSIGNED": "unsigned integer", "RECORD": "struct/class"}[self.name]


class ErrorRecord(ctypes.Structure):
    """struct EmuError."""
    _fields_ = [("code", ctypes.c_int32), ("space", ctypes.c_int32), ("block", ctypes.c_int32 * 3),
                ("thread", ctypes.c_int32 * 3), ("other_block", ctypes.c_int32 * 3),
                ("other_thread", ctypes.c_int32 * 3), ("is_write", ctypes.c_int32),
                ("other_is_write", ctypes.c_int32), ("size", ctypes.c_int32), ("arg_index", ctypes.c_int32),
                ("addr", ctypes.c_uint64), ("offset", ctypes.c_int64), ("pc", ctypes.c_uint64),
                ("other_pc", ctypes.c_uint64), ("msg", ctypes.c_char * 8192)]


# name: (restype, argtypes) of the functions runtime.cpp exports
_FUNCTIONS = {
    "__emu_error_record_size": (ctypes.c_int, []),
    "__emu_init": (ctypes.c_int, [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]),
    "__emu_kernel_info": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int),
                                         ctypes.POINTER(ctypes.POINTER(ctypes.c_int))]),
    "__emu_launch_start": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                          ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_int,
                                          ctypes.c_ulonglong, ctypes.c_int]),
    "__emu_launch_wait": (ctypes.c_int, [ctypes.c_int]),
    "__emu_launch_end": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ErrorRecord)]),
    "__emu_launch_traffic": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]),
    "__emu_bench_switch": (ctypes.c_double, [ctypes.c_long]),
}


class Runtime:
    """The runtime functions of one loaded library, with their C signatures."""

    def __init__(self, lib: ctypes.CDLL):
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("__emu_"), fn)
