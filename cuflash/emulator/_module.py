"""RawModule / RawKernel: compile CUDA C with g++ against the emulator shim, load, launch."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from ._errors import (BoundsError, DeadlockError, EmulatorCompileError, EmulatorError, KernelFault, KernelTrap,
                      RaceError)

_HERE = Path(__file__).resolve().parent
_RUNTIME_DIR = _HERE / "runtime"
_SHIM = _RUNTIME_DIR / "shim.h"
_RUNTIME_SRC = _RUNTIME_DIR / "runtime.cpp"
_LAUNCHER_VERSION = "3"

SCHEDULES = {"round-robin": 0, "reversed": 1, "random": 2}
_DEFAULT_SMEM = 48 * 1024
_MAX_SMEM = 232448

_lock = threading.RLock()
_loaded: dict = {}          # cache key -> _Library
_runtime_objs: dict = {}    # runtime object path cache


# --------------------------------------------------------------------------------------------
# toolchain discovery
def _compiler() -> str:
    cxx = os.environ.get("CUFLASH_EMULATOR_CXX") or os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise EmulatorError(
            f"the CUDA emulator needs a C++ compiler, but {cxx!r} was not found on PATH. "
            "Install g++ (e.g. `apt-get install g++` or `conda install gxx_linux-64`), "
            "or point CUFLASH_EMULATOR_CXX at one.")
    return path


_cxx_version_cache: dict = {}


def _compiler_version(cxx: str) -> str:
    if cxx not in _cxx_version_cache:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _cxx_version_cache[cxx] = out.stdout.splitlines()[0] if out.stdout else "?"
    return _cxx_version_cache[cxx]


_cuda_inc_cache: list = []


def _cuda_include_dirs() -> list:
    """Directories that provide cuda_fp16.h / cuda_bf16.h and what they include (crt/, nv/target)."""
    if _cuda_inc_cache:
        return list(_cuda_inc_cache[0])
    dirs = []
    env = os.environ.get("CUFLASH_EMULATOR_CUDA_INCLUDE")
    if env:
        dirs += [d for d in env.split(os.pathsep) if d]
    try:
        import nvidia.cuda_runtime as _rt  # type: ignore
        for p in _rt.__path__:
            if (Path(p) / "include" / "cuda_fp16.h").exists():
                dirs.append(str(Path(p) / "include"))
    except ImportError:
        pass
    try:
        import nvidia.cuda_nvcc as _nvcc  # type: ignore  (crt/host_defines.h lives here)
        for p in _nvcc.__path__:
            if (Path(p) / "include" / "crt").is_dir():
                dirs.append(str(Path(p) / "include"))
    except ImportError:
        pass
    have = lambda rel: any((Path(d) / rel).exists() for d in dirs)  # noqa: E731
    if not have("nv/target"):
        try:
            import importlib.util
            spec = importlib.util.find_spec("cupy")  # locate without importing (imports are slow)
            if spec is not None and spec.origin:
                cand = Path(spec.origin).parent / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
                if (cand / "nv" / "target").exists():
                    dirs.append(str(cand))
        except Exception:
            pass
    cuda_home = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    for sub in ("include", "include/cccl"):
        d = Path(cuda_home) / sub
        if d.is_dir():
            dirs.append(str(d))
    if not have("cuda_fp16.h") and not any((Path(d) / "cuda_fp16.h").exists() for d in dirs):
        raise EmulatorError(
            "the CUDA emulator needs the CUDA headers cuda_fp16.h/cuda_bf16.h: "
            "`pip install nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12` (or set CUDA_PATH / "
            "CUFLASH_EMULATOR_CUDA_INCLUDE)")
    _cuda_inc_cache.append(tuple(dirs))
    return list(dirs)


def _cache_dir() -> Path:
    base = os.environ.get("CUFLASH_CACHE_DIR")
    d = Path(base) / "emulator" if base else Path(os.path.expanduser("~/.cache/cuflash/emulator"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------------------------
# option handling
_IGNORED_FLAG_PREFIXES = ("-arch", "--gpu-architecture", "-lineinfo", "--generate-line-info", "--use_fast_math",
                          "-use_fast_math", "-default-device", "--device-as-default-execution-space", "-G",
                          "--device-debug", "-rdc", "--relocatable-device-code", "-dlto", "--dlink-time-opt",
                          "-ftz", "--ftz", "-prec-div", "--prec-div", "-prec-sqrt", "--prec-sqrt", "-fmad",
                          "--fmad", "-maxrregcount", "--maxrregcount", "-restrict", "--restrict", "-ewp",
                          "--extensible-whole-program", "-dw", "--disable-warnings", "-w", "-Werror",
                          "--extra-device-vectorization", "-extra-device-vectorization", "-minimal",
                          "--minimal", "-split-compile", "--split-compile", "-time", "--time",
                          "-err-no", "--display-error-number", "-no-source-include", "--no-source-include",
                          "-builtin-move-forward", "-builtin-initializer-list", "-pch", "--pch",
                          "-jump-table-density", "-device-int128", "--device-int128", "-Xptxas")


def _parse_options(options) -> tuple:
    """Translate an NVRTC option tuple into (include_dirs, defines, std)."""
    if isinstance(options, str):
        options = (options,)
    opts = list(options or ())
    incs, defs, std = [], [], "c++17"
    i = 0
    while i < len(opts):
        o = str(opts[i])
        nxt = str(opts[i + 1]) if i + 1 < len(opts) else None
        if o in ("-I", "--include-path"):
            incs.append(nxt); i += 2; continue
        if o.startswith("--include-path="):
            incs.append(o.split("=", 1)[1])
        elif o.startswith("-I"):
            incs.append(o[2:])
        elif o in ("-D", "--define-macro"):
            defs.append(nxt); i += 2; continue
        elif o.startswith("--define-macro="):
            defs.append(o.split("=", 1)[1])
        elif o.startswith("-D"):
            defs.append(o[2:])
        elif o in ("-U", "--undefine-macro"):
            defs.append("!" + nxt); i += 2; continue
        elif o.startswith("-U"):
            defs.append("!" + o[2:])
        elif o.startswith(("--std=", "-std=")):
            s = o.split("=", 1)[1]
            std = s if s.startswith(("c++", "gnu++")) else "c++17"
        elif o in ("-std", "--std"):
            std = nxt or std; i += 2; continue
        elif o in ("-include", "--pre-include"):
            defs.append("@" + nxt); i += 2; continue
        elif o in ("-arch", "--gpu-architecture", "-maxrregcount", "--maxrregcount"):
            i += 2; continue
        # every other option is NVRTC-only (code generation, debug info): ignored on the CPU
        i += 1
    if std in ("c++03", "c++11", "c++14"):
        std = "c++17"  # the shim needs C++17; the kernel source compiles the same
    return incs, defs, std


def _hash_dir(h, d: str) -> None:
    p = Path(d)
    if not p.is_dir():
        return
    exts = (".h", ".hpp", ".cuh", ".cu", ".inc", ".inl", ".hh", ".hxx")
    n = 0
    for root, dirnames, files in os.walk(p):
        dirnames[:] = sorted(x for x in dirnames if not x.startswith((".", "__pycache__")))
        if Path(root).relative_to(p).parts.__len__() > 4:
            dirnames[:] = []
        for f in sorted(files):
            if f.endswith(exts):
                fp = Path(root) / f
                try:
                    h.update(str(fp.relative_to(p)).encode())
                    h.update(fp.read_bytes())
                except OSError:
                    pass
                n += 1
                if n > 2000:
                    return


# --------------------------------------------------------------------------------------------
# compiled library
class _ErrorStruct(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("space", ctypes.c_int32), ("block", ctypes.c_int32 * 3),
                ("thread", ctypes.c_int32 * 3), ("other_block", ctypes.c_int32 * 3),
                ("other_thread", ctypes.c_int32 * 3), ("is_write", ctypes.c_int32),
                ("other_is_write", ctypes.c_int32), ("size", ctypes.c_int32), ("arg_index", ctypes.c_int32),
                ("addr", ctypes.c_uint64), ("offset", ctypes.c_int64), ("pc", ctypes.c_uint64),
                ("other_pc", ctypes.c_uint64), ("msg", ctypes.c_char * 8192)]


class _Library:
    """One loaded shared library: all name expressions of one (source, options, mode)."""

    def __init__(self, path: Path, names: list, checked: bool, source_path: Path):
        self.path = path
        self.names = names
        self.checked = checked
        self.source_path = source_path
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        self._launch_lock = threading.Lock()
        syms = _read_tls_symbols(path)
        anchor = syms.get("__emu_tls_anchor")
        dyn = syms.get("__emu_dyn_smem")
        if anchor is None or dyn is None:
            raise EmulatorError(f"emulator library {path} lacks runtime symbols")
        self.anchor_off = anchor[0]
        self.dyn_off = dyn[0]
        self.static_shared = []   # (offset, size, demangled name)
        self.dynamic_names = []
        for name, (val, size) in syms.items():
            if "__emu_" in name or name.startswith(("_ZTH", "_ZTW")):
                continue
            if val == self.dyn_off:
                self.dynamic_names.append(name)
            elif size > 0:
                self.static_shared.append((val, size, name))
        demangled = _demangle([s[2] for s in self.static_shared] + self.dynamic_names)
        self.static_shared = [(o, s, demangled.get(n, n)) for o, s, n in self.static_shared]
        self.dynamic_names = [demangled.get(n, n) for n in self.dynamic_names]
        arr = (ctypes.c_int64 * (2 * max(1, len(self.static_shared))))()
        for i, (o, s, _) in enumerate(self.static_shared):
            arr[2 * i], arr[2 * i + 1] = o, s
        getattr(self.lib, "__emu_init").restype = ctypes.c_int
        getattr(self.lib, "__emu_init").argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        stack_kb = int(os.environ.get("CUFLASH_EMULATOR_STACK_KB", "0") or 0)
        n = getattr(self.lib, "__emu_init")(self.anchor_off, len(self.static_shared), arr, stack_kb)
        if n != len(names):
            raise EmulatorError(f"emulator library {path}: expected {len(names)} kernels, found {n}")
        getattr(self.lib, "__emu_kernel_info").argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                               ctypes.POINTER(ctypes.c_int),
                                               ctypes.POINTER(ctypes.POINTER(ctypes.c_int))]
        self.params = []
        for k in range(n):
            nm, npar, par = ctypes.c_char_p(), ctypes.c_int(), ctypes.POINTER(ctypes.c_int)()
            getattr(self.lib, "__emu_kernel_info")(k, ctypes.byref(nm), ctypes.byref(npar), ctypes.byref(par))
            m = npar.value
            self.params.append([(par[i], par[m + i]) for i in range(m)])
        getattr(self.lib, "__emu_launch").restype = ctypes.c_int
        getattr(self.lib, "__emu_launch").argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                          ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_int,
                                          ctypes.c_ulonglong, ctypes.c_int, ctypes.POINTER(_ErrorStruct)]

    def addr2line(self, pcs) -> list:
        """(function, file:line) of module-relative return addresses (None where unknown)."""
        if shutil.which("addr2line") is None:
            return [None] * len(pcs)
        res = []
        for p in pcs:
            if not p:
                res.append(None)
                continue
            # -i prints the inlining chain innermost first; the first pair is the access itself
            o = subprocess.run(["addr2line", "-C", "-i", "-f", "-e", str(self.path), hex(p - 1)],
                               capture_output=True, text=True).stdout.splitlines()
            if len(o) >= 2:
                res.append((o[0], re.sub(r" \(discriminator \d+\)", "", o[1])))
            else:
                res.append(None)
        return res


def _read_tls_symbols(path: Path) -> dict:
    out = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise EmulatorError(f"readelf failed on {path}: {out.stderr}")
    syms = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[3] == "TLS" and parts[6] != "UND":
            syms[parts[7].split("@")[0]] = (int(parts[1], 16), int(parts[2], 0) if parts[2].isdigit() else int(parts[2], 16))
    return syms


def _demangle(names: list) -> dict:
    if not names or shutil.which("c++filt") is None:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {}


def _undefined_tls(obj: Path) -> list:
    out = subprocess.run(["readelf", "-sW", str(obj)], capture_output=True, text=True).stdout
    res = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[3] == "TLS" and parts[6] == "UND" and "__emu_" not in parts[7]:
            res.append(parts[7].split("@")[0])
    return res


def _launcher_source(src_file: Path, names: list) -> str:
    lines = [f'#include "{src_file}"', "", "// ---- generated by cuflash.emulator ----",
             "#include <utility>",
             "#include <type_traits>",
             "struct __emu_kernel_entry_t { const char* name; void (*invoke)(void*, void**); void* fn;",
             "                              int nparams; const int* params; };",
             "template <class T> constexpr int __emu_kind() {",
             "  return std::is_pointer<T>::value ? 1 : std::is_floating_point<T>::value ? 2",
             "       : std::is_integral<T>::value ? (std::is_signed<T>::value ? 3 : 4) : 5; }",
             "template <class... A> struct __emu_sig { static const int params[2 * sizeof...(A) + 1]; };",
             "template <class... A> const int __emu_sig<A...>::params[2 * sizeof...(A) + 1] =",
             "  { (int)sizeof(A)..., __emu_kind<A>()..., 0 };",
             "template <class... A, std::size_t... I> __attribute__((no_sanitize(\"thread\")))",
             "static inline void __emu_call(void (*fn)(A...), void** argv, std::index_sequence<I...>) {",
             "  (void)argv; fn(*static_cast<typename std::remove_cv<A>::type*>(argv[I])...); }",
             "template <class... A> __attribute__((no_sanitize(\"thread\"))) static void __emu_invoke(void* fn, void** argv) {",
             "  __emu_call(reinterpret_cast<void (*)(A...)>(fn), argv, std::index_sequence_for<A...>{}); }",
             "template <class... A> static __emu_kernel_entry_t __emu_entry(const char* name, void (*fn)(A...)) {",
             "  return {name, &__emu_invoke<A...>, reinterpret_cast<void*>(fn), (int)sizeof...(A),",
             "          __emu_sig<A...>::params}; }",
             'extern "C" __attribute__((visibility("default"))) const __emu_kernel_entry_t __emu_kernel_table[] = {']
    for n in names:
        lit = n.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'  __emu_entry("{lit}", &{n}),')
    lines.append("  {nullptr, nullptr, nullptr, 0, nullptr}};")
    lines.append(f'extern "C" __attribute__((visibility("default"))) const int __emu_kernel_count = {len(names)};')
    return "\n".join(lines) + "\n"


_MARKERS = {
    "__cuflash_emulator_error__inline_PTX_asm_is_not_supported_by_the_emulator":
        "inline PTX assembly (`asm(...)` / `asm volatile(...)`) cannot run on the CPU emulator; "
        "put it in a wrapper function with an `#ifdef CUFLASH_EMULATOR` C++ implementation",
    "__cuflash_emulator_error__cooperative_groups_are_not_supported_by_the_emulator":
        "cooperative groups (<cooperative_groups.h>) are not supported by the CPU emulator; "
        "use __syncthreads()/__syncwarp() and the *_sync warp intrinsics",
}


def _compile_error(stderr: str, src_display: str) -> EmulatorCompileError:
    hints = []
    for marker, text in _MARKERS.items():
        if marker in stderr:
            locs = sorted(set(re.findall(r"^([^\s:]+:\d+):\d+: error: [^\n]*" + marker, stderr, re.M)))
            hints.append(text + (f" (at {', '.join(locs)})" if locs else ""))
    if not hints and "cooperative_groups" in stderr:
        hints.append(_MARKERS["__cuflash_emulator_error__cooperative_groups_are_not_supported_by_the_emulator"])
    for marker in _MARKERS:
        stderr = stderr.replace(marker, "asm" if "asm" in marker else "cooperative_groups")
    lines = stderr.splitlines()
    if len(lines) > 120:
        lines = lines[:120] + [f"... ({len(lines) - 120} more lines)"]
    msg = f"compiling {src_display} for the CPU emulator failed:\n" + "\n".join(lines)
    if hints:
        msg = "; ".join(hints) + "\n\n" + msg
    return EmulatorCompileError(msg)


def _run(cmd, cwd=None):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


def _runtime_object(cxx: str, cache: Path) -> Path:
    """The runtime (fibers, scheduler, hooks), compiled once per runtime source and compiler."""
    src = _RUNTIME_SRC.read_bytes()
    key = hashlib.sha256(src + _compiler_version(cxx).encode() + cxx.encode()).hexdigest()[:24]
    obj = cache / f"runtime-{key}.o"
    if obj.exists():
        return obj
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / "runtime.o"
        r = _run([cxx, "-std=c++17", "-O2", "-fPIC", "-fno-gnu-unique", "-fvisibility=hidden",
                  "-fno-omit-frame-pointer", "-c", str(_RUNTIME_SRC), "-o", str(out)])
        if r.returncode != 0:
            raise EmulatorError("compiling the emulator runtime failed:\n" + r.stderr)
        os.replace(out, obj)
    return obj


def _precompiled_shim(cxx: str, cache: Path, common: list, sys_incs: list) -> Path:
    """shim.h with a precompiled header next to it (cuts ~1 s of header parsing per compile).

    GCC uses ``shim.h.gch`` only when it is valid for the compile's flags and macros, and
    falls back to the text header otherwise, so a stale or mismatched PCH is harmless.
    """
    if os.environ.get("CUFLASH_EMULATOR_NO_PCH"):
        return _SHIM
    text = _SHIM.read_bytes()
    key = hashlib.sha256(text + repr((common, sys_incs, _compiler_version(cxx), cxx)).encode()).hexdigest()[:24]
    d = cache / f"pch-{key}"
    if (d / "shim.h.gch").exists():
        return d / "shim.h"
    tmp = Path(tempfile.mkdtemp(prefix="pchbuild-", dir=cache))
    try:
        (tmp / "shim.h").write_bytes(text)
        r = _run([cxx] + common + sys_incs + ["-x", "c++-header", str(tmp / "shim.h"), "-o", str(tmp / "shim.h.gch")])
        if r.returncode != 0:
            return _SHIM  # the real compile will show the error
        try:
            os.rename(tmp, d)
        except OSError:
            pass  # another process won the race; use theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d / "shim.h" if (d / "shim.h.gch").exists() else _SHIM


def _build(code: str, src_path, options, names: list, checked: bool) -> _Library:
    cxx = _compiler()
    incs, defs, std = _parse_options(options)
    cuda_incs = _cuda_include_dirs()
    src_dir = Path(src_path).resolve().parent if src_path else None
    h = hashlib.sha256()
    for part in (_LAUNCHER_VERSION, code, repr(tuple(map(str, options or ()))), repr(names), str(checked),
                 _compiler_version(cxx), cxx, repr(cuda_incs), str(src_path or "")):
        h.update(part.encode() + b"\0")
    h.update(_SHIM.read_bytes())
    h.update(_RUNTIME_SRC.read_bytes())
    h.update(_launcher_source(Path("K"), names).encode())
    h.update(Path(__file__).read_bytes())  # compile flags and launcher generator
    for d in incs + ([str(src_dir)] if src_dir else []):
        h.update(str(Path(d).resolve()).encode())
        _hash_dir(h, d)
    key = h.hexdigest()[:32]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        cache = _cache_dir()
        so = cache / f"k-{key}.so"
        if not so.exists():
            rt = _runtime_object(cxx, cache)
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
                std_flag = f"-std={'gnu++17' if std == 'c++17' else std}"
                common = [std_flag, "-fPIC", "-fno-extern-tls-init", "-fno-gnu-unique", "-fstack-clash-protection",
                          "-fno-strict-aliasing", "-fno-omit-frame-pointer", "-w", "-fvisibility=hidden"]
                if checked:
                    common += ["-O1", "-g", "-gdwarf-4", "-fsanitize=thread", "--param",
                               "tsan-instrument-func-entry-exit=0", "--param", "tsan-distinguish-volatile=0"]
                else:
                    common += ["-O2"]
                sys_incs = []
                for d in cuda_incs:
                    sys_incs += ["-isystem", d]
                shim = _precompiled_shim(cxx, cache, common, sys_incs)
                flags = [cxx] + common + ["-x", "c++", "-include", str(shim), "-I", str(_RUNTIME_DIR)]
                if src_dir:
                    flags += ["-I", str(src_dir)]
                for d in incs:
                    flags += ["-I", d]
                flags += sys_incs
                # -D/-U of the user's own macros go into the launcher after the shim, so that the
                # precompiled shim stays valid (GCC rejects a PCH when a -D name occurs in it);
                # CUDA configuration macros stay on the command line, ahead of the CUDA headers
                pre = []
                for d in defs:
                    name = d.lstrip("!@").split("=", 1)[0]
                    early = name.startswith(("__CUDA", "CUDA", "__CUDACC", "_GLIBCXX", "__STDC", "_GNU"))
                    if d.startswith("@"):
                        flags += ["-include", d[1:]]
                    elif d.startswith("!"):
                        flags.append("-U" + d[1:]) if early else pre.append(f"#undef {name}")
                    elif early:
                        flags.append("-D" + d)
                    else:
                        val = d.split("=", 1)[1] if "=" in d else "1"
                        pre.append(f"#define {name} {val}")
                launcher = tmp / "launcher.cpp"
                launcher.write_text("\n".join(pre) + "\n" + _launcher_source(src_file, names))
                obj = tmp / "kernel.o"
                r = _run(flags + ["-c", str(launcher), "-o", str(obj)])
                if r.returncode != 0:
                    raise _compile_error(r.stderr, str(src_path) if src_path else "the kernel source")
                link = [cxx, "-shared", "-o", str(tmp / "lib.so"), str(rt), str(obj), "-Wl,-Bsymbolic",
                        "-Wl,-z,defs", "-lm", "-lpthread"]
                for sym in _undefined_tls(obj):
                    link.append(f"-Wl,--defsym={sym}=__emu_dyn_smem")
                r = _run(link)
                if r.returncode != 0:
                    raise _compile_error(r.stderr, "the emulator library (link step)")
                os.replace(tmp / "lib.so", so)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        lib = _Library(so, names, checked, Path(src_path) if src_path else cache / f"k-{key}.cu")
        _loaded[key] = lib
        return lib


# --------------------------------------------------------------------------------------------
# public classes
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


_KIND_NAMES = {1: "pointer", 2: "floating-point", 3: "signed integer", 4: "unsigned integer", 5: "struct/class"}


class RawModule:
    """Drop-in for ``cupy.RawModule`` running the kernels on the CPU on NumPy arrays.

    ``code`` is CUDA C source (or ``path`` a ``.cu`` file); ``options`` the NVRTC option tuple
    (``-I``, ``-D``, ``-std`` are honoured, GPU-only ones ignored); ``name_expressions`` the
    kernel names/template instantiations to build. ``checked=True`` (or ``CUFLASH_EMULATOR_CHECKED=1``)
    runs launches with race and bounds checking; ``schedule`` picks the thread order inside a block
    ("round-robin", "reversed", "random" with ``seed``).
    """

    def __init__(self, code=None, path=None, options=(), name_expressions=(), checked=False,
                 schedule="round-robin", seed=0, **unused):
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
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if isinstance(options, str):
            options = (options,)
        self.code = code
        self.path = path
        self.options = tuple(options or ())
        self.name_expressions = [str(n) for n in (name_expressions or ())]
        self.checked = bool(checked)
        self.schedule = schedule
        self.seed = int(seed)
        self._extra = []
        self._libs = {}
        self._mlock = threading.RLock()

    def _names(self) -> list:
        names = list(self.name_expressions)
        names += [n for n in self._extra if n not in names]
        return names

    def _library(self, checked: bool) -> _Library:
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
                    lib = _build(self.code, self.path, self.options, names + auto, checked)
                except EmulatorCompileError:
                    lib = _build(self.code, self.path, self.options, names, checked)
            else:
                lib = _build(self.code, self.path, self.options, names, checked)
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
        self.max_dynamic_shared_size_bytes = _DEFAULT_SMEM
        self.preferred_shared_memory_carveout = -1
        self.attributes = {}

    # CuPy exposes these read-only attributes; plausible values for an emulated device
    max_threads_per_block = 1024
    num_regs = 0
    local_size_bytes = 0

    @property
    def shared_size_bytes(self):
        return 0

    def _lib(self, checked: bool):
        lib = self.module._library(checked)
        return lib, lib.names.index(self.name)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise EmulatorError("cooperative launches are not supported by the CPU emulator")
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
        allowed = max(_DEFAULT_SMEM, int(self.max_dynamic_shared_size_bytes))
        if shared_mem > allowed:
            raise ValueError(
                f"launch of {self.name} asks for {shared_mem} bytes of dynamic shared memory but the kernel's "
                f"max_dynamic_shared_size_bytes is {self.max_dynamic_shared_size_bytes}; set "
                f"kernel.max_dynamic_shared_size_bytes = {shared_mem} first (a GPU launch would fail too)")
        if shared_mem > _MAX_SMEM:
            raise ValueError(f"shared_mem={shared_mem} exceeds the largest shared memory of any GPU ({_MAX_SMEM})")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of arrays and NumPy scalars, got {type(args).__name__}")
        checked = self.module.checked or _checked_from_env()
        lib, k = self._lib(checked)
        params = lib.params[k]
        if len(args) != len(params):
            raise TypeError(f"kernel {self.name} takes {len(params)} arguments, got {len(args)}")
        holders, argv, ranges = [], (ctypes.c_void_p * max(1, len(args)))(), []
        arrays = {}
        for i, (a, (size, kind)) in enumerate(zip(args, params)):
            if isinstance(a, np.ndarray):
                if kind != 1:
                    raise TypeError(f"argument {i} of {self.name}: got a NumPy array but the kernel parameter is a "
                                    f"{size}-byte {_KIND_NAMES.get(kind, '?')} passed by value")
                if not a.flags.writeable and False:
                    pass
                ptr = a.__array_interface__["data"][0]
                lo, hi = _extent(a)
                ranges += [lo, hi - lo, i]
                arrays[i] = a
                v = ctypes.c_void_p(ptr)
            elif hasattr(a, "__cuda_array_interface__"):
                raise TypeError(f"argument {i} of {self.name}: a GPU array ({type(a).__name__}) cannot be used by "
                                "the CPU emulator; pass a NumPy array")
            elif isinstance(a, np.generic):
                if kind == 1:
                    raise TypeError(f"argument {i} of {self.name}: the kernel parameter is a pointer but got a "
                                    f"scalar {a.dtype}; pass a NumPy array")
                if a.dtype.itemsize != size:
                    raise TypeError(f"argument {i} of {self.name}: the kernel parameter is a {size}-byte "
                                    f"{_KIND_NAMES.get(kind, '?')}, got {a.dtype} ({a.dtype.itemsize} bytes)")
                dk = a.dtype.kind
                if kind == 2 and dk != "f":
                    raise TypeError(f"argument {i} of {self.name}: the kernel parameter is floating-point, "
                                    f"got {a.dtype}")
                if kind in (3, 4) and dk not in "iub":
                    raise TypeError(f"argument {i} of {self.name}: the kernel parameter is an integer, got {a.dtype}")
                v = ctypes.create_string_buffer(a.tobytes(), max(size, 1))
            elif isinstance(a, (bool, int, float, complex)):
                raise TypeError(f"argument {i} of {self.name}: Python {type(a).__name__} {a!r} has no fixed C type; "
                                "wrap it in a NumPy scalar of the kernel's parameter type (e.g. numpy.int32(n), "
                                "numpy.float32(x))")
            else:
                raise TypeError(f"argument {i} of {self.name}: unsupported type {type(a).__name__}; pass NumPy "
                                "arrays and NumPy scalars")
            holders.append(v)
            argv[i] = ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
        nr = len(ranges) // 3
        rarr = (ctypes.c_ulonglong * max(1, len(ranges)))(*ranges)
        garr = (ctypes.c_uint * 3)(*g)
        barr = (ctypes.c_uint * 3)(*b)
        err = _ErrorStruct()
        workers = 1 if checked else _workers()
        with lib._launch_lock:
            code = getattr(lib.lib, "__emu_launch")(k, garr, barr, shared_mem, argv, nr, rarr, int(checked),
                                        SCHEDULES[self.module.schedule], self.module.seed, workers,
                                        ctypes.byref(err))
        del holders
        if code:
            raise _make_error(err, lib, self.name, args)


_EXTERN_C_RE = re.compile(r'extern\s+"C"\s+(?:__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void'
                          r'|void\s+__global__)\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\(')


def _extern_c_kernels(code: str) -> list:
    """Names of `extern "C" __global__ void name(` kernels (plain identifiers, buildable by name)."""
    stripped = re.sub(r"//[^\n]*|/\*.*?\*/", " ", code, flags=re.S)
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


def _fmt3(v) -> str:
    return f"({v[0]},{v[1]},{v[2]})"


def _where(lib: _Library, pc: int) -> str:
    if not pc:
        return "unknown location"
    r = lib.addr2line([pc])[0]
    if not r or r[1].startswith("??"):
        return f"pc +{pc:#x} in {lib.path.name}"
    fn, loc = r
    return f"{loc} (in {fn})"


def _shared_name(lib: _Library, space: int, off: int) -> str:
    if space == 2:
        names = ", ".join(lib.dynamic_names) or "dynamic shared memory"
        return f"extern __shared__ {names} (dynamic shared memory) at byte offset {off}"
    for o, s, n in lib.static_shared:
        if o <= off < o + s:
            return f"__shared__ {n} at byte offset {off - o} (of {s})"
    return f"static shared memory at TLS offset {off}"


def _make_error(err: _ErrorStruct, lib: _Library, kname: str, args) -> EmulatorError:
    code = err.code
    msg = err.msg.decode(errors="replace").rstrip()
    blk, thr = _fmt3(err.block), _fmt3(err.thread)
    who = f"thread {thr} of block {blk}"
    if code == 2:  # race
        rw = "writes" if err.is_write else "reads"
        if err.space == 3:
            ai = err.arg_index
            arr = args[ai] if 0 <= ai < len(args) else None
            desc = (f"argument {ai} ({arr.dtype}[{arr.size}]) at byte offset {err.offset}" if arr is not None
                    else f"address {err.addr:#x}")
            other = _fmt3(err.other_block)
            prev = "wrote" if err.other_is_write else "read"
            if err.other_thread[0] >= 0 or (err.other_pc and tuple(err.other_block) == tuple(err.block)):
                ow = f"thread {_fmt3(err.other_thread)}" if err.other_thread[0] >= 0 else "other threads"
                return RaceError(
                    f"{kname}: global-memory race between threads of one block on {desc}: {who} {rw} "
                    f"{err.size} byte(s) at {_where(lib, err.pc)}; {ow} {prev} it at {_where(lib, err.other_pc)} "
                    "with no __syncthreads() in between")
            text = (f"inter-block race on global memory {desc}: {who} {rw} {err.size} byte(s) at "
                    f"{_where(lib, err.pc)}, but block {other} already {prev} it in this launch "
                    "(blocks run in any order on a GPU)")
        else:
            var = _shared_name(lib, err.space, err.offset)
            prev = "wrote" if err.other_is_write else "read"
            if err.other_thread[0] >= 0:
                ow = f"thread {_fmt3(err.other_thread)}"
            else:
                ow = "other threads"
            text = (f"shared-memory race on {var}: {who} {rw} {err.size} byte(s) at {_where(lib, err.pc)}; "
                    f"{ow} {prev} it at {_where(lib, err.other_pc)} with no __syncthreads() in between")
        return RaceError(f"{kname}: {text}")
    if code == 3:  # bounds
        rw = "write" if err.is_write else "read"
        if err.space == 3:
            ai = err.arg_index
            near = ""
            if 0 <= ai < len(args) and isinstance(args[ai], np.ndarray):
                a = args[ai]
                nb = a.size * a.itemsize
                off = err.offset
                rel = (f"{-off} bytes before its start" if off < 0 else f"{off - nb} bytes past its end"
                       if off >= nb else f"at byte offset {off}")
                near = (f"; nearest array is argument {ai} ({a.dtype}{list(a.shape)}, {nb} bytes), "
                        f"the access is {rel}")
            text = (f"out-of-bounds global {rw} of {err.size} byte(s) at address {err.addr:#x} by {who} at "
                    f"{_where(lib, err.pc)}: not inside any array argument{near}")
        else:
            var = _shared_name(lib, err.space, err.offset)
            text = (f"out-of-bounds shared-memory {rw} of {err.size} byte(s) on {var} by {who} at "
                    f"{_where(lib, err.pc)}: beyond the launch's shared memory")
        return BoundsError(f"{kname}: {text}")
    if code == 4:
        return DeadlockError(f"{kname}: {msg}")
    if code == 5:
        return KernelTrap(f"{kname}: {who}: {msg}")
    if code == 6:
        return KernelFault(f"{kname}: {who}: {msg}")
    return EmulatorError(f"{kname}: {msg or 'launch failed'}")


def context_switch_ns(iterations: int = 1_000_000) -> float:
    """Measured cost of one fiber context switch, in nanoseconds (-1 where not x86-64)."""
    lib = _build('extern "C" __global__ void __emu_noop() {}', None, (), ["__emu_noop"], False)
    f = getattr(lib.lib, "__emu_bench_switch")
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_long]
    return float(f(int(iterations)))
