"""Building an emulator library: the cache key, compiling and linking with g++, and the
runtime object and precompiled shim that every library shares, all in the on-disk cache."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import compiler
from . import _headers
from ._elf import undefined_tls
from ._errors import EmulatorCompileError, EmulatorError
from ._launcher import launcher_source
from ._library import Library
from ._ptx import ERROR_FUNCTION, translate
from ._toolchain import cxx as find_cxx, cxx_version, parse_options
from .archs import Arch

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
SHIM = RUNTIME_DIR / "shim.h"
_ABI_H = RUNTIME_DIR / "abi.h"
_RUNTIME_SRCS = (RUNTIME_DIR / "runtime.cpp", RUNTIME_DIR / "ptx.cpp", RUNTIME_DIR / "sm90.cpp")
_RUNTIME_HEADERS = (_ABI_H, RUNTIME_DIR / "ptx.h", RUNTIME_DIR / "runtime.h")
# what the emulator itself puts into every library: the runtime, the shim, the compile flags
# (this file), the generated launcher and the inline-PTX translator with its arch table
_EMULATOR_FILES = (*_RUNTIME_SRCS, *_RUNTIME_HEADERS, SHIM, Path(__file__),
                   *(Path(__file__).with_name(n) for n in ("_launcher.py", "_ptx.py", "_ptx_sm90.py", "archs.py")))
_SOURCE_EXTS = (".h", ".hpp", ".cuh", ".cu", ".inc", ".inl", ".hh", ".hxx")
# macros that must reach the CUDA headers, so they stay on the command line (see build())
_EARLY_MACROS = ("__CUDA", "CUDA", "__CUDACC", "_GLIBCXX", "__STDC", "_GNU")

_lock = threading.RLock()
_loaded: dict = {}   # cache key -> Library


def availability() -> tuple:
    """(True, the compiler and CUDA headers the emulator builds with) or (False, what to install).
    Looks for them only: nothing is compiled."""
    problems, cxx, dirs = [], None, []
    try:
        cxx = find_cxx()
    except EmulatorError as e:
        problems.append(str(e))
    try:
        dirs = _headers.include_dirs()
    except EmulatorError as e:
        problems.append(str(e))
    if problems:
        return False, "\n".join(problems)
    v = compiler.cuda_version(dirs[0])
    cuda = f"CUDA {v // 1000}.{v % 1000 // 10}" if v else "CUDA"
    return True, f"{cxx}, {cuda} headers in {', '.join(dirs)}"


def _hash_sources(h, d: Path) -> None:
    """Every source file under `d`, by relative path and content."""
    for root, dirnames, files in os.walk(d):
        dirnames[:] = sorted(x for x in dirnames if not x.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(_SOURCE_EXTS):
                fp = Path(root) / f
                h.update(str(fp.relative_to(d)).encode() + b"\0" + fp.read_bytes())


def cache_key(code: str, src_path, options, names: list, checked: bool, cxx: str, cuda_dirs: list,
              arch: str = "sm_80") -> str:
    """Hash of everything that goes into the library.

    A CUDA toolkit's include directory (one with cuda_runtime_api.h) counts by its path and
    CUDA version, not by its ~100-2000 headers; every other -I directory (and the source's
    own, for path=) by the content of its sources, as the kernel headers live there.
    """
    opts = parse_options(options)
    h = hashlib.sha256()
    for part in (code, repr(tuple(map(str, options))), repr(names), str(checked), arch, str(src_path or ""),
                 cxx, cxx_version(cxx), repr(cuda_dirs),
                 repr(compiler.cuda_version(cuda_dirs[0]) if cuda_dirs else None)):
        h.update(part.encode() + b"\0")
    for f in _EMULATOR_FILES:
        h.update(f.read_bytes())
    local = [Path(src_path).resolve().parent] if src_path else []
    for d in map(Path, opts.include_dirs):
        if (d / "cuda_runtime_api.h").exists():
            h.update(f"{d.resolve()}\0{compiler.cuda_version(str(d))}\0".encode())
        elif d.is_dir():
            local.append(d.resolve())
    for d in local:
        h.update(str(d).encode() + b"\0")
        _hash_sources(h, d)
    for f in map(Path, opts.pre_includes):
        h.update(str(f).encode() + b"\0" + (f.read_bytes() if f.is_file() else b""))
    return h.hexdigest()[:32]


def build(code: str, src_path, options, names: list, checked: bool, arch: Arch) -> Library:
    """The loaded library of `names` from `code` for the emulated `arch`: from this process,
    the disk cache, or g++."""
    cxx = find_cxx()
    cuda_dirs = _headers.include_dirs()
    key = cache_key(code, src_path, options, names, checked, cxx, cuda_dirs, arch.name)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        cache = compiler.cache_dir("emulator")
        cache.mkdir(parents=True, exist_ok=True)
        so = cache / f"k-{key}.so"
        if not so.exists():
            _compile_and_link(code, src_path, options, names, checked, arch, cxx, cuda_dirs, cache, key, so)
        lib = Library(so, names, checked)
        _loaded[key] = lib
        return lib


def _compile_and_link(code, src_path, options, names, checked, arch, cxx, cuda_dirs, cache: Path, key: str,
                      so: Path):
    opts = parse_options(options)
    rt = _runtime_objects(cxx, cache)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
    try:
        if src_path:
            src_file = Path(src_path).resolve()
        else:
            # the source lives next to the library, so file:line in reports points at a real file
            src_file = cache / f"k-{key}.cu"
            if not src_file.exists() or src_file.read_text() != code:
                (tmp / "kernel.cu").write_text(code)
                os.replace(tmp / "kernel.cu", src_file)
        common = [f"-std={'gnu++17' if opts.std == 'c++17' else opts.std}", "-fPIC", "-fno-extern-tls-init",
                  "-fno-gnu-unique", "-fstack-clash-protection", "-fno-strict-aliasing", "-fno-omit-frame-pointer",
                  "-w", "-fvisibility=hidden"]
        if checked:
            common += ["-O1", "-g", "-gdwarf-4", "-fsanitize=thread", "--param",
                       "tsan-instrument-func-entry-exit=0", "--param", "tsan-distinguish-volatile=0"]
        else:
            common += ["-O2"]
        sys_incs = [arg for d in cuda_dirs for arg in ("-isystem", d)]
        shim = _precompiled_shim(cxx, cache, common, sys_incs)
        flags = [cxx] + common + ["-x", "c++", "-include", str(shim), "-I", str(RUNTIME_DIR)]
        if src_path:
            flags += ["-I", str(src_file.parent)]
        for d in opts.include_dirs:
            flags += ["-I", d]
        flags += sys_incs
        for f in opts.pre_includes:
            flags += ["-include", f]
        # -D/-U of the user's own macros go into the launcher after the shim, so that the
        # precompiled shim stays valid (GCC rejects a PCH when a -D name occurs in it);
        # CUDA configuration macros stay on the command line, ahead of the CUDA headers
        late = []
        for name, value in opts.macros:
            if not name.startswith(_EARLY_MACROS):
                late.append((name, value))
            else:
                flags.append(f"-U{name}" if value is None else f"-D{name}={value}")
        # __CUDA_ARCH__ is defined after the shim: the CUDA headers must take their host paths
        launcher = tmp / "launcher.cpp"
        arch_macros = [("__CUDA_ARCH__", str(arch.cuda_arch))]
        if arch.feature_macro:
            arch_macros.append((arch.feature_macro, "1"))
        launcher.write_text(launcher_source(src_file, names, arch_macros + late))
        # preprocess (the precompiled shim stays a pragma), put runtime calls in place of inline
        # PTX, compile the result
        src_display = str(src_path) if src_path else "the kernel source"
        r = _run(flags + ["-E", "-fpch-preprocess", str(launcher), "-o", str(tmp / "launcher.ii")])
        if r.returncode != 0:
            raise _compile_error(r.stderr, src_display)
        (tmp / "kernel.ii").write_text(translate((tmp / "launcher.ii").read_text(), arch))
        obj = tmp / "kernel.o"
        compile_flags = [f for i, f in enumerate(flags) if f != "-include" and (i == 0 or flags[i - 1] != "-include")]
        r = _run(compile_flags + ["-fpreprocessed", "-x", "c++-cpp-output", "-c", str(tmp / "kernel.ii"),
                                  "-o", str(obj)])
        if r.returncode != 0:
            raise _compile_error(r.stderr, src_display)
        link = [cxx, "-shared", "-o", str(tmp / "lib.so"), *map(str, rt), str(obj), "-Wl,-Bsymbolic",
                "-Wl,-z,defs", "-lm", "-lpthread"]
        # every extern __shared__ array is the one dynamic shared-memory buffer
        link += [f"-Wl,--defsym={sym}=__emu_dyn_smem" for sym in undefined_tls(obj)]
        r = _run(link)
        if r.returncode != 0:
            raise _compile_error(r.stderr, "the emulator library (link step)")
        os.replace(tmp / "lib.so", so)   # atomic: concurrent processes share the cache safely
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def _runtime_objects(cxx: str, cache: Path) -> list:
    """The runtime (fibers, scheduler, hooks; PTX semantics), compiled once per source and compiler."""
    headers = b"".join(h.read_bytes() for h in _RUNTIME_HEADERS)
    objs = []
    for src in _RUNTIME_SRCS:
        key = hashlib.sha256(src.read_bytes() + headers + cxx_version(cxx).encode() + cxx.encode()).hexdigest()[:24]
        obj = cache / f"{src.stem}-{key}.o"
        objs.append(obj)
        if obj.exists():
            continue
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / f"{src.stem}.o"
            r = _run([cxx, "-std=c++17", "-O2", "-fPIC", "-fno-gnu-unique", "-fvisibility=hidden",
                      "-fno-omit-frame-pointer", "-c", str(src), "-o", str(out)])
            if r.returncode != 0:
                raise EmulatorError(f"compiling the emulator runtime ({src.name}) failed:\n" + r.stderr)
            os.replace(out, obj)
    return objs


def _precompiled_shim(cxx: str, cache: Path, common: list, sys_incs: list) -> Path:
    """shim.h with a precompiled header next to it (cuts ~1 s of header parsing per compile).

    GCC uses ``shim.h.gch`` only when it is valid for the compile's flags and macros, and
    falls back to the text header otherwise, so a stale or mismatched PCH is harmless.
    """
    if os.environ.get("CUFLASH_EMULATOR_NO_PCH"):
        return SHIM
    text = SHIM.read_bytes()
    key = hashlib.sha256(text + _ABI_H.read_bytes()
                         + repr((common, sys_incs, cxx_version(cxx), cxx)).encode()).hexdigest()[:24]
    d = cache / f"pch-{key}"
    if (d / "shim.h.gch").exists():
        return d / "shim.h"
    tmp = Path(tempfile.mkdtemp(prefix="pchbuild-", dir=cache))
    try:
        (tmp / "shim.h").write_bytes(text)
        r = _run([cxx] + common + ["-I", str(RUNTIME_DIR)] + sys_incs
                 + ["-x", "c++-header", str(tmp / "shim.h"), "-o", str(tmp / "shim.h.gch")])
        if r.returncode != 0:
            return SHIM  # the real compile will show the error
        try:
            os.rename(tmp, d)
        except OSError:
            pass  # another process won the race; use theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d / "shim.h" if (d / "shim.h.gch").exists() else SHIM


# Constructs the shim turns into compile errors with these names (see shim.h)
_MARKERS = {
    "__cuflash_emulator_error__cooperative_groups_are_not_supported_by_the_emulator":
        "cooperative groups (<cooperative_groups.h>) are not supported by the CPU emulator; "
        "use __syncthreads()/__syncwarp() and the *_sync warp intrinsics",
}


def _compile_error(stderr: str, src_display: str) -> EmulatorCompileError:
    # inline PTX the emulator cannot run, in code a kernel reaches (see _ptx.py)
    hints = list(dict.fromkeys(re.findall(rf"{ERROR_FUNCTION}\d+\W* declared with attribute error: ([^\n]*)", stderr)))
    for marker, text in _MARKERS.items():
        if marker in stderr:
            locs = sorted(set(re.findall(r"^([^\s:]+:\d+):\d+: error: [^\n]*" + marker, stderr, re.M)))
            hints.append(text + (f" (at {', '.join(locs)})" if locs else ""))
    if not hints and "cooperative_groups" in stderr:
        hints.append(_MARKERS["__cuflash_emulator_error__cooperative_groups_are_not_supported_by_the_emulator"])
    for marker in _MARKERS:
        stderr = stderr.replace(marker, "cooperative_groups")
    lines = stderr.splitlines()
    if len(lines) > 120:
        lines = lines[:120] + [f"... ({len(lines) - 120} more lines)"]
    msg = f"compiling {src_display} for the CPU emulator failed:\n" + "\n".join(lines)
    if hints:
        msg = "\n".join(hints) + "\n\n" + msg
    return EmulatorCompileError(msg)
