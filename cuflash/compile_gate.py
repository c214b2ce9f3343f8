"""The compile gate: every kernel specialization cuflash can launch, built for every
architecture in `ARCHS` that the installed NVRTC targets (the compiler CuPy uses at run
time) and assembled by `ptxas -v`; a specialization that fails to compile or spills any
bytes to local memory fails the gate. Disassembled (nvdisasm), each tensor-core
specialization also carries the static cost of its main loop's steady-state iteration
(`sass_cost`), and fails when that iteration shows fewer exp2 than its tile has scores:
a softmax left in a rolled loop, which the count cannot see. Needs no GPU, and no
ml_dtypes: NVRTC knows bfloat16 as `__nv_bfloat16`, so the gate builds the bfloat16
kernels regardless.

Programmable attention compiles a call's score_mod / mask_mod into the kernels
(programmable/cuda_c.py): the gate builds one such specialization per attention kernel
family (`MOD_ARCHS`), with an example of each (a table lookup and a document mask), a
block mask and the table's gradient, as the pseudo-source "<file>+mods_f32" (or _f64): the
generated code, then the file; and so, on every arch, the kernel that finds a block
mask's tiles (block_mask.cu), which exists only with a mask_mod compiled in.

`python -m cuflash check-kernels` calls `check_kernels()`, which prints the table.

What CuPy really compiles (cupy/cuda/compiler.py, CuPy 14, read for this gate):
  * `RawModule(code, options, name_expressions)` → `_compile_module_with_cache` →
    `_compile_with_cache_cuda`, which appends `-ftz=true`, then
    `_compile_using_nvrtc_no_warning`, which appends `-arch=sm_XY` (cubin; the device's
    compute capability from `_get_arch()`, capped at NVRTC's maximum; `compute_XY`/PTX
    only when CUPY_COMPILE_WITH_PTX is set) and `--device-as-default-execution-space`
    (the `-default-device` of the NVRTC docs), plus `--pch` only when
    CUPY_NVRTC_USE_PCH is set on NVRTC >= 12.8.
  * `_get_arch()` queries `device.Device().compute_capability`, so CuPy cannot compile
    without a GPU; NVRTC itself can, given an explicit `-arch`. The gate therefore calls
    NVRTC directly (`cupy.cuda.nvrtc`) with `compiler.nvrtc_options(arch)` plus the two
    options CuPy appends (`CUPY_APPENDED_OPTIONS`), and asks for PTX (`compute_XY`
    would be equivalent; `-arch=sm_XY` with getPTX gives the same PTX) which it
    assembles with ptxas for the same `sm_XY`, as NVRTC does internally for cubin.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import compiler, sass_cost
from .families import FLASH_BWD_DKDV_TC, FLASH_BWD_DQ_TC, FLASH_FWD_TC
from .plans.sm90_bwd import all_sm90_bwd_plans
from .plans.sm90_fwd import all_sm90_fwd_plans

# The options CuPy's RawModule adds to the caller's (see the module docstring).
CUPY_APPENDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

CACHE_VERSION = 3

# The architectures the gate proves: compiler.GATE_ARCHS and Blackwell, which runs the
# sm_80/sm_90 mma.sync plans (B200 sm_100 with 227 KB of shared memory per block, the
# consumer sm_120 with 99 KB) and which NVRTC targets from CUDA 12.8 on.
ARCHS = tuple(dict.fromkeys((*compiler.GATE_ARCHS, "sm_100", "sm_120", "sm_90a")))

# The kernels of an architecture-specific target ("a": sm_90a's wgmma and setmaxnreg), built
# for it alone, and the SASS each must show: the proof that Hopper's machinery reached the
# machine code (warpgroup MMA, tensor-memory loads, the mbarrier's SYNCS unit).
SPECIFIC = {"sm_90a": {"sm90_gemm.cu": ["sm90_gemm"],
                       "flash_fwd_sm90.cu": [p.name_expression
                                             for p in all_sm90_fwd_plans()],
                       "flash_bwd_sm90.cu": [p.name_expression
                                             for p in all_sm90_bwd_plans()]}}
REQUIRED_SASS = {"sm90_gemm": ("HGMMA", "UTMALDG", "SYNCS"),
                 "flash_fwd_sm90_kernel": ("HGMMA", "UTMALDG", "SYNCS"),
                 "flash_bwd_dkdv_sm90_kernel": ("HGMMA", "UTMALDG", "SYNCS"),
                 "flash_bwd_dq_sm90_kernel": ("HGMMA", "UTMALDG", "SYNCS")}

# The archs on which the gate builds a generated score_mod / mask_mod specialization of every
# attention kernel family: one mma.sync generation with every SIMT and tensor-core family,
# and Hopper's own.
MOD_ARCHS = ("sm_80", "sm_90a")
_MOD_TABLE = np.zeros((16, 64), np.float32)
_MOD_DOC = np.zeros(4096, np.int32)


def _example_score_mod(score, b, h, q_idx, kv_idx):
    return score + _MOD_TABLE[h % 16, min(abs(q_idx - kv_idx) // 16, 63)]


def _example_mask_mod(b, h, q_idx, kv_idx):
    return _MOD_DOC[q_idx % 4096] == _MOD_DOC[kv_idx % 4096]


@functools.cache
def example_mods_code(acc):
    """The generated code of the gate's example score_mod and mask_mod, with a block
    mask and the score_mod's gradients, for the accumulation type `acc` ("f32" or
    "f64")."""
    from .programmable import translate
    from .programmable.cuda_c import kernel_mods
    return kernel_mods(np, translate(_example_score_mod, "score_mod"),
                       translate(_example_mask_mod, "mask_mod"),
                       np.float32 if acc == "f32" else np.float64, block_mask=True,
                       grads=True).code


def mod_specializations(specs):
    """{"<file>+mods_<acc>": [name expressions]}: of every attention kernel family in
    `specs` and element type, its last specialization (the widest head dim)."""
    out = {}
    for filename, names in specs.items():
        last = {}
        for n in names:
            family, _, args = n.partition("<")
            element = args.split(",")[0]
            if family.startswith(("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq")) and \
                    not family.startswith("flash_bwd_dq_sum"):
                last[family, element] = n
        for (_, element), n in last.items():
            acc = "f64" if element == "double" else "f32"
            out.setdefault(f"{filename}+mods_{acc}", []).append(n)
    return out


def source_text(filename):
    """The text the gate compiles for `filename`: a file of cuflash/kernels, or a
    "+mods_<acc>" pseudo-source (the example mods' code, then the file)."""
    base, _, tag = filename.partition("+")
    text = compiler.read_source(base)
    return text if not tag else example_mods_code(tag.removeprefix("mods_")) + text


# Why an NVRTC may lack an arch of ARCHS: each CUDA release adds and drops some.
_ARCH_RANGE = {"sm_70": "CUDA 12.9 is the last toolkit that targets sm_70",
               "sm_100": "CUDA 12.8 is the first toolkit that targets sm_100",
               "sm_120": "CUDA 12.8 is the first toolkit that targets sm_120"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One specialization on one architecture."""
    source: str
    kernel: str          # the name expression, e.g. "flash_bwd_dq_kernel<float, 64, ...>"
    arch: str
    registers: int = -1
    smem: int = -1       # static shared memory, bytes
    spill_stores: int = -1
    spill_loads: int = -1
    error: str = ""
    wgmma_serialized: bool = False   # ptxas made the wgmma wait one for another (C7520)
    sass: dict | None = None   # opcode counts (SASS_OPCODES) when built with sass=True
    cost: sass_cost.LoopCost | None = None   # the main loop's, for COSTED kernels with sass

    def __post_init__(self):
        if isinstance(self.cost, dict):   # read back from the JSON cache
            object.__setattr__(self, "cost", sass_cost.LoopCost(**self.cost))

    @property
    def local_memory(self):
        """LDL/STL in the disassembly (None when not disassembled)."""
        return None if self.sass is None else self.sass["LDL"] + self.sass["STL"]

    @property
    def exp2_needed(self):
        """The MUFU.EX2 the main loop's iteration must show (`sass_cost.exp2_needed` of the
        kernel's plan), None where no cost was counted or no loop was found."""
        plan = _plans().get(self.kernel)
        if self.cost is None or not self.cost.found or plan is None:
            return None
        return sass_cost.exp2_needed(plan)

    @property
    def rolled_softmax(self):
        """Whether the iteration shows fewer exp2 than its tile's scores."""
        need = self.exp2_needed
        return need is not None and self.cost.mufu_ex2 < need

    @property
    def missing_sass(self):
        """The opcodes REQUIRED_SASS asks of this kernel that its disassembly lacks."""
        if self.sass is None:
            return ()
        return tuple(o for o in REQUIRED_SASS.get(self.kernel.partition("<")[0], ())
                     if not self.sass.get(o))

    @property
    def ok(self):
        return (not self.error and self.spill_stores == 0 and self.spill_loads == 0
                and not self.local_memory and not self.rolled_softmax and not self.missing_sass
                and not self.wgmma_serialized)

    @property
    def status(self):
        if self.error:
            return "ERROR: " + self.error.strip().splitlines()[0][:160] if self.error.strip() else "ERROR"
        if self.spill_stores or self.spill_loads:
            return "SPILL"
        if self.local_memory:
            return "LOCAL MEMORY"
        if self.missing_sass:
            return "NO " + ", ".join(self.missing_sass)
        if self.wgmma_serialized:
            return "WGMMA SERIALIZED"
        if self.rolled_softmax:
            return (f"ROLLED SOFTMAX ({self.cost.mufu_ex2} MUFU.EX2 per iteration, "
                    f"{self.exp2_needed} scores per thread)")
        return "ok"


@functools.cache
def _plans():
    from . import tiling
    return tiling.every_plan()


def ptxas_path():
    """ptxas of the CUDA wheel that matches NVRTC's major version (CUDA 12:
    `nvidia-cuda-nvcc-cu12`, nvidia/cuda_nvcc; CUDA 13+: `nvidia-cuda-nvcc`, nvidia/cu13),
    else the one on PATH. A PTX file from a newer NVRTC does not assemble with an older
    ptxas, so the two must come from one release."""
    from cupy.cuda import nvrtc
    major = nvrtc.getVersion()[0]
    wheel_dir = "cuda_nvcc" if major <= 12 else f"cu{major}"
    try:
        import nvidia
        for base in nvidia.__path__:
            exe = pathlib.Path(base) / wheel_dir / "bin" / "ptxas"
            if exe.exists():
                return str(exe)
    except ImportError:
        pass
    exe = shutil.which("ptxas")
    if exe is None:
        raise RuntimeError(f"ptxas not found: install the CUDA {major} nvcc wheel "
                           f"({'nvidia-cuda-nvcc-cu12' if major <= 12 else 'nvidia-cuda-nvcc'}) "
                           "or put CUDA's bin directory on PATH")
    return exe


# Instructions counted in the disassembly (nvdisasm) of a sass=True build: tensor-core
# mma, ldmatrix, cp.async, and local memory (which must stay absent); and what REQUIRED_SASS asks.
_REQUIRED_OPCODES = tuple(dict.fromkeys(o for v in REQUIRED_SASS.values() for o in v))
SASS_OPCODES = ("HMMA", "LDSM", "LDGSTS", "LDL", "STL", *_REQUIRED_OPCODES)

# The kernels whose main loop's static cost a sass=True build counts: the tensor-core ones.
COSTED = (*(f.function for f in (FLASH_FWD_TC, FLASH_BWD_DKDV_TC, FLASH_BWD_DQ_TC)),
          "flash_fwd_sm90_kernel", "flash_bwd_dkdv_sm90_kernel", "flash_bwd_dq_sm90_kernel")


def nvdisasm_path():
    """nvdisasm from a CUDA wheel (`nvidia-cuda-nvdisasm`: nvidia/cu13/bin; CUDA 12:
    nvidia/cuda_nvdisasm/bin) or PATH; None when there is none. It reads cubins of older
    toolkits' ptxas; CUDA 13's no longer disassembles sm_70."""
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in ("cuda_nvdisasm/bin", *sorted((p.name + "/bin" for p in
                                                       pathlib.Path(base).glob("cu[0-9]*")),
                                                      reverse=True)):
                exe = pathlib.Path(base) / sub / "nvdisasm"
                if exe.exists():
                    return str(exe)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


@functools.cache
def _nvdisasm_major():
    out = subprocess.run([nvdisasm_path() or "nvdisasm", "--version"], capture_output=True,
                         text=True).stdout
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else 0


def nvdisasm_reads(arch):
    """Whether the installed nvdisasm disassembles `arch` (13.x dropped sm_70: those builds
    are gated by ptxas alone)."""
    return not (arch == "sm_70" and _nvdisasm_major() >= 13)


_SASS_FUNCTION = re.compile(r"^//-+ \.text\.(\S+) +-+$", re.M)
_SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_functions(text):
    """{mangled name: its part of nvdisasm's listing}."""
    parts = _SASS_FUNCTION.split(text)
    return dict(zip(parts[1::2], parts[2::2]))


def parse_sass(text):
    """{mangled name: {opcode: count}} of nvdisasm's listing, for SASS_OPCODES."""
    out = {}
    for name, body in sass_functions(text).items():
        ops = _SASS_OPCODE.findall(body)
        out[name] = {op: ops.count(op) for op in SASS_OPCODES}
    return out


def gate_options(arch):
    """The NVRTC options of the gate for `arch`: exactly what CuPy compiles with."""
    return compiler.nvrtc_options(arch) + CUPY_APPENDED_OPTIONS


# ptxas -v prints, per kernel:
#   ptxas info    : Compiling entry function '_Z...' for 'sm_80'
#   ptxas info    : Function properties for _Z...
#       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
#   ptxas info    : Used 40 registers, used 0 barriers, 16384 bytes smem, 400 bytes cmem[0]
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# …and, where it has to make a function's wgmma wait for one another (their accumulators
# touched across a branch it cannot see through), a line naming the function:
#   ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are
#   serialized due to … in the function '_Z...'
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized.*function '([^']+)'")


def parse_ptxas(log):
    """{mangled name: {"registers", "smem", "spill_stores", "spill_loads",
    "wgmma_serialized"}}."""
    out = {}
    current = None
    serialized = set(_SERIALIZED.findall(log))
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(m.group(1), _ptxas_entry(m.group(1) in serialized))
            continue
        m = _PROPS.search(line)
        if m:
            current = out.setdefault(m.group(1), _ptxas_entry(m.group(1) in serialized))
            continue
        if current is None:
            continue
        m = _SPILL.search(line)
        if m:
            current["spill_stores"] = int(m.group(1))
            current["spill_loads"] = int(m.group(2))
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["smem"] = int(s.group(1)) if s else 0
    return out


def _ptxas_entry(serialized):
    return {"registers": 0, "smem": 0, "spill_stores": 0, "spill_loads": 0,
            "wgmma_serialized": serialized}


def compile_one(source_text, name_expressions, arch, *, source_name="kernel.cu",
                options=None, sass=False):
    """One NVRTC program with all `name_expressions`, for `arch`, then ptxas -v (and, with
    `sass`, nvdisasm of the cubin: `Row.sass`, and `Row.cost` of the COSTED kernels).

    Returns a list of Row (one per name expression). Runs in a worker process.
    """
    from cupy.cuda import nvrtc

    options = tuple(options) if options is not None else gate_options(arch)
    rows = []
    try:
        prog = nvrtc.createProgram(source_text, source_name, (), ())
    except Exception as e:  # pragma: no cover - NVRTC missing
        return [Row(source_name, n, arch, error=f"nvrtc: {e}") for n in name_expressions]
    try:
        for n in name_expressions:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:
                log = ""
            msg = f"NVRTC failed ({e}):\n{log}"
            return [Row(source_name, n, arch, error=msg) for n in name_expressions]
        ptx = nvrtc.getPTX(prog)
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)

    if isinstance(ptx, bytes):
        ptx = ptx.decode()
    ptx = ptx.rstrip("\x00")
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file = pathlib.Path(tmp) / "k.ptx"
        ptx_file.write_text(ptx)
        proc = subprocess.run(
            [ptxas_path(), f"-arch={arch}", "-v", str(ptx_file), "-o", str(pathlib.Path(tmp) / "k.cubin")],
            capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            return [Row(source_name, n, arch, error=f"ptxas failed:\n{log}") for n in name_expressions]
        counts, listings = {}, {}
        sass = sass and nvdisasm_reads(arch)
        if sass:
            dis = subprocess.run([nvdisasm_path() or "nvdisasm", "-c", str(pathlib.Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
            if dis.returncode != 0:
                return [Row(source_name, n, arch, error=f"nvdisasm failed:\n{dis.stderr}")
                        for n in name_expressions]
            counts = parse_sass(dis.stdout)
            listings = sass_functions(dis.stdout)
    info = parse_ptxas(log)
    for n in name_expressions:
        k = info.get(lowered[n])
        if k is None:
            rows.append(Row(source_name, n, arch, error=f"no ptxas report for {lowered[n]}"))
            continue
        costed = sass and n.partition("<")[0] in COSTED and lowered[n] in listings
        rows.append(Row(source_name, n, arch, **k, sass=counts.get(lowered[n]) if sass else None,
                        cost=sass_cost.loop_cost(listings[lowered[n]]) if costed else None))
    return rows


# ── the cache: results keyed by source hash (with every header) + options + names ──

def _cache_dir():
    return compiler.cache_dir("compile_gate")


def _key(source_text, names, arch, options, sass=False):
    h = hashlib.sha256()
    h.update(f"v{CACHE_VERSION}\0{arch}\0".encode())
    if sass:  # the listing's counts and cost: the counter's own source is part of the key
        h.update(f"sass\0{nvdisasm_path()}\0{_tool_version(nvdisasm_path())}\0".encode())
        h.update(pathlib.Path(sass_cost.__file__).read_bytes())
        h.update(repr((SASS_OPCODES, _SASS_FUNCTION.pattern, _SASS_OPCODE.pattern)).encode())
    h.update("\0".join(options).encode() + b"\1")
    h.update("\0".join(names).encode() + b"\1")
    h.update(source_text.encode())
    # Headers are part of the program: hash every local header it includes (transitively),
    # so an edit to another kernel family's header does not invalidate this file's entry.
    for name in sorted(_local_includes(source_text)):
        h.update(name.encode() + b"\0" + (compiler.KERNEL_DIR / name).read_bytes())
    try:
        from cupy.cuda import nvrtc
        h.update(repr((nvrtc.getVersion(), _nvrtc_wheels())).encode())
    except Exception:
        pass
    # the tools by path and version: a wheel upgraded in place keeps its path
    h.update(f"{ptxas_path()}\0{_tool_version(ptxas_path())}".encode())
    return h.hexdigest()


@functools.cache
def _nvrtc_wheels():
    """The installed NVRTC wheels' versions (getVersion() gives no patch release)."""
    from importlib import metadata
    out = []
    for name in ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc"):
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return tuple(out)


@functools.cache
def _tool_version(path):
    """What `path --version` prints (ptxas, nvdisasm): their build, for the cache key."""
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _local_includes(text, seen=None):
    """Names of the cuflash/kernels/ headers `text` includes, directly or not."""
    seen = set() if seen is None else seen
    for name in _INCLUDE.findall(text):
        path = compiler.KERNEL_DIR / name
        if name not in seen and path.is_file():
            seen.add(name)
            _local_includes(path.read_text(), seen)
    return seen


def _load(key):
    try:
        data = json.loads((_cache_dir() / f"{key}.json").read_text())
        return [Row(**r) for r in data]
    except (OSError, ValueError, TypeError):
        return None


def _store(key, rows):
    try:
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
        tmp.replace(d / f"{key}.json")
    except OSError:
        pass


def arch_cc(arch: str) -> tuple[int, int]:
    """The compute capability of "sm_XY" / "sm_XYZ" (the last digit is the minor)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def collect_specializations(arch=None):
    """{filename: [name expressions]}: every specialization cuflash can launch on `arch`
    ("sm_80"; None: on any arch). Plans depend on the arch (sm_120's float32 tiles); an
    architecture-specific target ("sm_90a") builds its own kernels (SPECIFIC) alone."""
    from . import tiling
    if arch in SPECIFIC:
        specs = dict(SPECIFIC[arch])
    else:
        specs = tiling.specializations(None if arch is None else arch_cc(arch))
        if arch is None:
            for extra in SPECIFIC.values():
                specs.update(extra)
    if arch in MOD_ARCHS:
        specs.update(mod_specializations(specs))
    if arch is not None and arch not in SPECIFIC:
        # the block-mask kernel (any GPU) exists only with a mask_mod compiled in: its
        # example's, in both accumulation types
        from .plans.block_mask import BlockMaskPlan
        specs.update({f"{BlockMaskPlan().source}+mods_{acc}":
                      [BlockMaskPlan().name_expression] for acc in ("f32", "f64")})
    return specs


def run_gate(specs=None, archs=None, *, jobs=None, use_cache=True, sources=None, sass=False,
             only=None):
    """Compile every specialization for every arch; returns a list of Row (with `sass`,
    each with its SASS opcode counts: nvdisasm must be installed).

    specs: {filename: [name expressions]} built for every arch (default: what cuflash can
    launch on each arch, `collect_specializations(arch)`); `only`: these filenames alone.
    sources: optional {filename: source text} overriding `compiler.read_source`
    (used to test that the gate catches errors and spills).
    """
    archs = tuple(archs or gate_archs()[0])
    per_arch = {a: {f: names for f, names in
                    (collect_specializations(a) if specs is None else specs).items()
                    if only is None or f in only} for a in archs}
    jobs = jobs or min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else (os.cpu_count() or 1), 8)
    results = {}
    todo = []
    for arch in archs:
        options = gate_options(arch)
        for filename, names in per_arch[arch].items():
            text = (sources or {}).get(filename)
            if text is None:
                text = source_text(filename)
            key = _key(text, names, arch, options, sass)
            cached = _load(key) if use_cache else None
            if cached is not None:
                results[(filename, arch)] = cached
            else:
                todo.append((filename, arch, text, list(names), options, key))
    if todo:
        # NVRTC holds the GIL only briefly, but ptxas and NVRTC are CPU-bound: processes.
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            futs = {pool.submit(compile_one, text, names, arch, source_name=filename,
                                options=options, sass=sass): (filename, arch, key)
                    for filename, arch, text, names, options, key in todo}
            for fut in concurrent.futures.as_completed(futs):
                filename, arch, key = futs[fut]
                try:
                    rows = fut.result()
                except Exception as e:  # a crashed worker is a failure, not a pass
                    rows = [Row(filename, n, arch, error=f"gate worker failed: {e!r}")
                            for n in per_arch[arch][filename]]
                results[(filename, arch)] = rows
                if use_cache and not any(r.error for r in rows):
                    _store(key, rows)
    return [row for arch in archs for filename in per_arch[arch]
            for row in results[(filename, arch)]]


def cached_registers(arch):
    """{name expression: registers} of every specialization whose gate result for `arch`
    is in the on-disk cache (from an earlier `check-kernels` or test run); compiles
    nothing. The plain kernels' (a generated specialization shares its name)."""
    out = {}
    try:
        options = gate_options(arch)
        for filename, names in collect_specializations(arch).items():
            if "+" in filename:
                continue
            text = source_text(filename)
            for sass in (True, False):
                rows = _load(_key(text, names, arch, options, sass))
                if rows:
                    out.update((r.kernel, r.registers) for r in rows)
                    break
    except Exception:  # no toolchain: nothing is known
        return {}
    return out


def blocks_per_sm(row):
    """Predicted resident blocks per SM of `row`'s kernel on the GPU the emulator stands
    for on `row.arch` (tiling.occupancy), or None for a kernel that is not a plan."""
    from . import tiling
    from .emulator import archs
    plan = _plans().get(row.kernel)
    if plan is None or row.arch not in archs.ARCHS or row.registers < 0:
        return None
    smem = row.smem + (plan.smem_bytes if plan.dynamic_smem else 0)
    return tiling.occupancy(archs.gpu_limits(row.arch), threads=plan.num_threads,
                            smem_bytes=smem, registers=row.registers)


# The main loop's columns: one steady-state iteration per warp (sass_cost.LoopCost).
COST_COLUMNS = ("loop", "loop HMMA", "EX2", "int/addr", "instr/HMMA")


def cost_cells(cost):
    """The COST_COLUMNS of a build: "-" where no cost was counted or no loop found."""
    if cost is None or not cost.found:
        return ("-",) * len(COST_COLUMNS)
    per = "-" if cost.per_hmma is None else f"{cost.per_hmma:.2f}"
    return (str(cost.total), str(cost.hmma), str(cost.mufu_ex2),
            str(cost.counts["int/addr"]), per)


def format_table(rows):
    """One line per build: registers, shared memory, spills, the disassembly's counts
    (where disassembled), the main loop's cost (tensor-core kernels) and the predicted
    blocks and warps per SM; " +mods" marks a build with the example mods compiled in."""
    plans = _plans()
    # the opcodes REQUIRED_SASS asks for only where a table holds a kernel that must show them
    required = {o for r in rows for o in REQUIRED_SASS.get(r.kernel.partition("<")[0], ())}
    ops = [o for o in SASS_OPCODES if o not in _REQUIRED_OPCODES or o in required]
    head = ("kernel", "arch", "regs", "smem", "spill st", "spill ld", *ops,
            *COST_COLUMNS, "blocks/SM", "warps/SM", "status")
    body = []
    for r in rows:
        counts = [str(r.sass[op]) if r.sass else "-" for op in ops]
        blocks = blocks_per_sm(r)
        warps = "-" if blocks is None else str(blocks * -(-plans[r.kernel].num_threads // 32))
        name = r.kernel + (" +mods" if "+mods" in r.source else "")   # the example mods
        body.append((name, r.arch, str(r.registers), str(r.smem), str(r.spill_stores),
                     str(r.spill_loads), *counts, *cost_cells(r.cost),
                     "-" if blocks is None else str(blocks), warps, r.status))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head) - 1)]
    lines = []
    for x in [head] + body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(x[:-1], widths))) + "  " + x[-1])
    return "\n".join(lines)


def nvrtc_archs() -> tuple[str, ...]:
    """The real architectures (sm_XY) the installed NVRTC can compile for."""
    from cupy.cuda import nvrtc
    return tuple(f"sm_{a}" for a in nvrtc.getSupportedArchs())


def split_archs(requested, supported, nvrtc_version):
    """(the requested archs NVRTC can build, {skipped arch: why}).

    Each CUDA release adds and drops architectures (CUDA 13's NVRTC no longer targets
    Volta, sm_70; Blackwell needs CUDA 12.8): those are reported, not failed, so the gate
    proves what the installed toolkit can build."""
    version = ".".join(map(str, nvrtc_version))
    # an "a" target comes with its architecture (NVRTC lists sm_90, and compiles sm_90a too)
    supported = tuple(supported) + tuple(f"{a}a" for a in supported)
    build = tuple(a for a in requested if a in supported)
    skipped = {a: f"NVRTC {version} cannot target {a}"
                  + (f" ({_ARCH_RANGE[a]})" if a in _ARCH_RANGE else "")
               for a in requested if a not in supported}
    return build, skipped


def gate_archs(requested=None):
    """split_archs() of `requested` (default: ARCHS) against the installed NVRTC."""
    from cupy.cuda import nvrtc
    return split_archs(tuple(requested or ARCHS), nvrtc_archs(), nvrtc.getVersion())


def check_kernels(argv=None) -> int:
    """Print the gate's table; return 0 when every specialization compiles spill-free on
    every requested arch the installed NVRTC can target (the others are listed as
    skipped, with the reason), and, disassembled, every tensor-core main loop shows an
    exp2 per score."""
    ap = argparse.ArgumentParser(
        prog="python -m cuflash check-kernels",
        description="Compile every kernel specialization cuflash can launch with NVRTC and "
                    "assemble it with ptxas -v for each architecture: registers, shared "
                    "memory, spills, the disassembly's tensor-core and local-memory "
                    "instructions, and the static cost of each tensor-core main loop's "
                    "steady-state iteration (instructions, HMMA, MUFU.EX2, integer/address, "
                    "instructions per HMMA). Exits 1 when one fails, spills, or its main "
                    "loop has fewer exp2 than scores (a softmax in a rolled loop). Needs "
                    "no GPU.")
    ap.add_argument("--arch", action="append", metavar="sm_XY",
                    help="an architecture to build for, repeatable (default: each of "
                         + ", ".join(ARCHS) + " that the installed NVRTC targets)")
    ap.add_argument("--source", action="append", metavar="FILE",
                    help="only this kernel source of cuflash/kernels/, repeatable, or a "
                         "FILE+mods_f32 / FILE+mods_f64 build with the example mods "
                         "(default: every source: "
                         + ", ".join(sorted(collect_specializations())) + ")")
    ap.add_argument("--no-cache", action="store_true",
                    help="rebuild everything, ignoring the on-disk results cache in "
                         f"{_cache_dir()} (default: use it)")
    ap.add_argument("-j", "--jobs", type=int, default=None,
                    help="parallel compilations (default: the usable CPUs, at most 8)")
    ap.add_argument("--no-sass", action="store_true",
                    help="skip the disassembly (HMMA/LDSM/LDGSTS/LDL/STL counts and the main "
                         "loops' cost; default: disassemble where nvdisasm is installed)")
    args = ap.parse_args(argv)
    sources = sorted({f for arch in ARCHS for f in collect_specializations(arch)})
    unknown = sorted(set(args.source or ()) - set(sources))
    if unknown:
        ap.error(f"--source {unknown[0]!r} is not a kernel source; choose from "
                 + ", ".join(sources))
    sass = not args.no_sass and nvdisasm_path() is not None
    t0 = time.perf_counter()
    archs, skipped = gate_archs(args.arch)
    rows = (run_gate(archs=archs, jobs=args.jobs, use_cache=not args.no_cache, sass=sass,
                     only=args.source) if archs else [])
    if rows:
        print(format_table(rows))
    bad = [r for r in rows if not r.ok]
    n_kernels = len({(r.source, r.kernel) for r in rows})
    print(f"\n{len(rows)} builds ({n_kernels} specializations x {len(archs)} archs) in "
          f"{time.perf_counter() - t0:.1f} s: {len(bad)} failed")
    for arch, why in skipped.items():
        print(f"skipped {arch}: {why}")
    if not sass:
        print("no disassembly: nvdisasm not found (the nvidia-cuda-nvdisasm wheel)"
              if not args.no_sass else "no disassembly (--no-sass)")
    for r in bad:
        if r.error:
            print(f"\n{r.kernel} [{r.arch}]:\n{r.error}", file=sys.stderr)
            break  # one full log is enough; the table names the rest
    if not archs:
        print("no requested architecture can be built with this NVRTC", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(check_kernels())
