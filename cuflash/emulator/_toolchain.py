"""The host toolchain: which C++ compiler builds emulated kernels, its version, and what an
NVRTC option list means to it."""
from __future__ import annotations

from typing import NamedTuple

from .. import compiler
from ._errors import EmulatorError

cxx_version = compiler.host_cxx_version  # first line of `cxx --version`


def cxx() -> str:
    """Path of the C++ compiler: $CUFLASH_EMULATOR_CXX, else $CXX, else g++."""
    name, path = compiler.host_cxx("CUFLASH_EMULATOR_CXX")
    if path is None:
        raise EmulatorError(
            f"the CUDA emulator needs a C++ compiler, but {name!r} was not found on PATH. "
            "Install g++ (e.g. `apt-get install g++` or `conda install gxx_linux-64`), "
            "or point CUFLASH_EMULATOR_CXX at one.")
    return path


class Options(NamedTuple):
    """What the emulator honours of an NVRTC option list."""
    include_dirs: tuple     # -I, in order
    macros: tuple           # (name, value) for -D (value "1" when none given), (name, None) for -U
    pre_includes: tuple     # -include FILE
    std: str                # "c++17" or newer


# NVRTC's spellings of the options the emulator honours, folded to one each
_SPELLINGS = {"-I": "-I", "--include-path": "-I", "-D": "-D", "--define-macro": "-D",
              "-U": "-U", "--undefine-macro": "-U", "-include": "-include", "--pre-include": "-include",
              "-std": "-std", "--std": "-std"}
# options that take the next argument as their value, though the emulator ignores them
_IGNORED_WITH_VALUE = ("-arch", "--gpu-architecture", "-maxrregcount", "--maxrregcount")


def _flags(opts):
    """(flag, value) of each option, `-Ifoo`, `-I foo` and `--include-path=foo` alike."""
    it = iter(opts)
    for o in it:
        if o in _SPELLINGS:
            yield _SPELLINGS[o], next(it, "")
        elif o in _IGNORED_WITH_VALUE:
            next(it, None)
        elif "=" in o and o.partition("=")[0] in _SPELLINGS:
            name, _, value = o.partition("=")
            yield _SPELLINGS[name], value
        elif o[:2] in ("-I", "-D", "-U"):
            yield o[:2], o[2:]


def parse_options(options) -> Options:
    """What an NVRTC option tuple asks of the host compiler; code-generation and debug
    options (-arch, --use_fast_math, -lineinfo, ...) mean nothing on the CPU."""
    opts = [str(o) for o in ((options,) if isinstance(options, str) else (options or ()))]
    incs, macros, pre, std = [], [], [], "c++17"
    for flag, value in _flags(opts):
        if flag == "-I":
            incs.append(value)
        elif flag == "-D":
            name, eq, val = value.partition("=")
            macros.append((name, val if eq else "1"))
        elif flag == "-U":
            macros.append((value, None))
        elif flag == "-include":
            pre.append(value)
        elif value.startswith(("c++", "gnu++")):
            std = value
    if std in ("c++03", "c++11", "c++14"):
        std = "c++17"  # the shim needs C++17; the kernel source compiles the same
    return Options(tuple(incs), tuple(macros), tuple(pre), std)
