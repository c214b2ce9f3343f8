"""`python -m cuflash`: info, demo, bench, check-kernels."""
import argparse
import csv
import dataclasses
import pathlib
import platform
import time
import tracemalloc

import numpy as np

import cuflash
from . import _dtypes, reference
from .flops import attention_flops


def _progress(iterable, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the `cli` extra; plain loop without it
        return iterable
    return tqdm(iterable, **kwargs)


def _gpu():
    """(cupy, device) when CuPy sees a CUDA device, else (None, reason)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (pip install 'cuflash[cuda12]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None, "CuPy sees no CUDA device"
    except Exception as exc:
        return None, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    return cupy, cupy.cuda.Device()


def best_backend():
    cupy, _ = _gpu()
    return "cuda" if cupy is not None else "numpy"


# -- info -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Target:
    """A GPU whose plans `info` lists: the gate arch whose registers apply, its compute
    capability and its limits (a `cuflash.emulator.GpuLimits`)."""
    arch: str
    cc: tuple
    limits: "cuflash.emulator.GpuLimits"


def _gate_target(arch):
    from .emulator import archs
    a = archs.ARCHS[arch]
    return _Target(arch, divmod(a.cuda_arch // 10, 10), a.limits)


def _device_target(cupy, dev, name):
    """The local GPU, its limits from the device's attributes."""
    from .emulator import archs
    a = dev.attributes
    cc = divmod(int(dev.compute_capability), 10)
    limits = archs.GpuLimits(
        name, a["MultiProcessorCount"], a["MaxThreadsPerMultiProcessor"],
        a["MaxBlocksPerMultiprocessor"], a["MaxRegistersPerMultiprocessor"],
        255,  # every architecture since sm_35
        a["MaxSharedMemoryPerBlock"], a["MaxSharedMemoryPerBlockOptin"],
        a["MaxSharedMemoryPerMultiprocessor"], a["ReservedSharedMemoryPerBlock"])
    return _Target(f"sm_{cc[0]}{cc[1]}", cc, limits)


def cmd_info(args):
    print(f"cuflash {cuflash.__version__} on Python {platform.python_version()}, "
          f"NumPy {np.__version__}")
    print(f"dtypes: {_dtypes.SUPPORTED_NAMES}"
          + ("" if _dtypes.BFLOAT16 is not None else " (bfloat16 needs ml_dtypes)"))
    cupy, dev = _gpu()
    print("backends:")
    from .backends import numpy_backend
    from .backends.numpy_backend import native
    config = numpy_backend.BACKEND.config
    lib, why = native.library(config.native)
    print(f"  numpy     available (blocked FlashAttention-2 on the CPU, {config.workers} "
          f"workers, exponentials in base {config.base.name}: NumPy's fastest on this CPU; "
          + (f"float32: the compiled {native.build(config.native)} kernels)" if lib else
             f"float32: the NumPy tiles, as {why})"))
    from .emulator import availability
    ok, why = availability()  # g++ and the CUDA headers, found, not tried
    print(f"  emulator  {'available, ' if ok else 'unavailable: '}{why}")
    targets = []
    if cupy is None:
        print(f"  cuda      unavailable: {dev}")
    else:
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        free, total = cupy.cuda.runtime.memGetInfo()
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"  cuda      {name}, compute capability {dev.compute_capability}, "
              f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
        targets.append(_device_target(cupy, dev, name))
    from .emulator import archs
    # the architectures whose limits cuflash holds (sm_90's list sm_90a's kernels too)
    known = tuple(a for a, x in archs.ARCHS.items() if not x.specific)
    for arch in args.arch or (known if args.verbose else ()):
        targets.append(_gate_target(arch))
    if not targets:
        print(f"plans: `--arch sm_XY` lists one architecture's ({', '.join(known)}), "
              "`--verbose` every one's")
    unknown = []
    for t in targets:
        if not _print_plans(t):
            unknown += [t.arch] + ["sm_90a"] * (tuple(t.cc) == (9, 0))
    if unknown:
        print(f"blocks per SM need the compile gate's registers: run `python -m cuflash "
              f"check-kernels {' '.join('--arch ' + a for a in unknown)}` once")
    if args.verbose:
        from . import compile_gate
        missing = [a for a in compile_gate.ARCHS if a not in known and a not in compile_gate.SPECIFIC]
        if missing:
            print(f"no device limits for {', '.join(missing)} (cuflash.emulator.archs): the "
                  f"compile gate builds them, info cannot list their plans")
    return 0


def _print_plans(target):
    """Print the forward and backward kernels `target` runs per dtype and head dim, why,
    and their blocks and warps per SM (the occupancy calculator's rules with the compile
    gate's registers); False when the gate's cache has no registers for them."""
    from . import compile_gate, tiling
    lim = target.limits
    sm90a = tuple(target.cc) == (9, 0)   # every cc 9.0 GPU runs sm_90a's kernels too
    registers = compile_gate.cached_registers(target.arch)
    specific = compile_gate.cached_registers("sm_90a") if sm90a else {}
    kwargs = {"max_smem": lim.shared_per_block_optin, "sm_count": lim.sm_count, "sm90a": sm90a}
    known = True

    def occupancy(plan):
        nonlocal known
        regs = (specific if plan.arch_specific else registers).get(plan.name_expression)
        if regs is None:
            known = False
            return ""
        blocks = tiling.occupancy(lim, threads=plan.num_threads, smem_bytes=plan.smem_bytes,
                                  registers=regs)
        warps = blocks * -(-plan.num_threads // 32)
        return (f"{blocks} block{'s' * (blocks != 1)}, {warps} warp{'s' * (warps != 1)} "
                f"per SM")

    print(f"plans on {target.arch} ({lim.gpu}: {lim.sm_count} SMs, "
          f"{lim.shared_per_block_optin // 1024} KiB shared memory per block):")
    lines = []  # (head, kernel, blocks per SM) or (reason,)
    # by name: bfloat16's plans need no ml_dtypes; float64 always runs the SIMT kernels
    for dtype in (n for n in tiling.DTYPE_NAMES if tiling.ELEMENTS[n].bytes < 8):
        for d in (64, 128, 256):
            fwd, why = tiling.forward_path(d, dtype, target.cc, plain=True, **kwargs)
            # the 5-GEMM pair only where its tile can beat two kernels' (tiling.dq_workers)
            bwd, bwd_why = tiling.backward_path(d, dtype, target.cc, **kwargs, plain=True,
                                                dq_parts=tiling.DQ_PARTS_TILE_COST < 1)
            lines += [(f"{dtype:9s} d={d:<4d} forward ", fwd.name_expression, occupancy(fwd)),
                      (why,)]
            lines += [(f"{'':17s}backward", p.name_expression, occupancy(p)) for p in bwd]
            if bwd_why != why:
                lines.append((bwd_why,))
    width = max(len(x[1]) for x in lines if len(x) == 3)
    for x in lines:
        print(f"  {x[0]} {x[1]:{width}s}  {x[2]}".rstrip() if len(x) == 3 else
              f"{'':28s}{x[0]}")
    decode_plan = tiling.forward_path(128, np.float16, target.cc, **kwargs)[0]
    print(f"  {_split_kv_example(decode_plan, lim.sm_count)}")
    return known


# A decode step: one query row per (batch row, head) against a long cache.
_DECODE = dict(B=1, Hq=32, Nq=1, Nk=8192)


def _split_kv_example(plan, sm_count):
    """How a decode step's keys are split over blocks on `sm_count` SMs (split-KV)."""
    from . import tiling
    e = _DECODE
    blocks = e["B"] * e["Hq"] * -(-e["Nq"] // plan.block_m)
    splits = tiling.split_kv_count(blocks, -(-e["Nk"] // plan.block_n), sm_count)
    return (f"split-KV: a float16 d=128 decode step (B={e['B']}, Hq={e['Hq']}, "
            f"Nq={e['Nq']}, Nk={e['Nk']}) has {blocks} query blocks for {sm_count} SMs: "
            f"{splits} key split{'s' * (splits != 1)}, {blocks * splits} blocks")


# -- checks and rates, shared by demo and bench ---------------------------------------

def significant(x, digits=3):
    """`x` in fixed notation with `digits` significant digits: an emulator's 0.000105
    GFLOP/s stays nonzero, a GPU's 312456 stays readable."""
    if not np.isfinite(x) or x == 0:
        return f"{x:g}"
    return f"{x:.{max(0, digits - 1 - int(np.floor(np.log10(abs(x)))))}f}"


def _worst_error(host, outputs, heads, causal):
    """Largest error relative to max(1, |reference|) of o, lse, dq, dk, dv over `heads`
    ((batch, head) pairs), against the float64 reference."""
    o, lse, dq, dk, dv = outputs
    worst = dict.fromkeys(("o", "lse", "dq", "dk", "dv"), 0.0)
    for i, j in heads:
        qh, kh, vh, doh = (a[i, j] for a in host)
        ro, rlse = reference.naive_attention(qh, kh, vh, causal=causal, return_lse=True)
        grads = reference.attention_backward(doh, qh, kh, vh, ro, rlse, causal=causal)
        for name, got, ref in (("o", o, ro), ("lse", lse, rlse), ("dq", dq, grads[0]),
                               ("dk", dk, grads[1]), ("dv", dv, grads[2])):
            err = np.max(np.abs(got[i, j].astype(np.float64) - ref), initial=0.0)
            worst[name] = max(worst[name], float(err / max(1.0, np.max(np.abs(ref)))))
    return worst


def _tolerance(dtype):
    return 1e-4 if np.dtype(dtype).itemsize >= 4 else 3e-2


# -- demo -------------------------------------------------------------------------------

class _Meter:
    """Peak memory beyond what was allocated before, on the host or the GPU."""

    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        if self.backend == "cuda":
            import cupy
            self.pool = cupy.get_default_memory_pool()
            self.pool.free_all_blocks()
            self.start = self.pool.used_bytes()
        else:
            from .backends.numpy_backend import release_buffers
            release_buffers()  # buffers kept from earlier calls would not count
            tracemalloc.start()
            tracemalloc.reset_peak()
        return self

    def peak(self):
        if self.backend == "cuda":
            return self.pool.total_bytes() - self.start
        return tracemalloc.get_traced_memory()[1]

    def __exit__(self, *exc):
        if self.backend != "cuda":
            tracemalloc.stop()


def _sync(backend):
    if backend == "cuda":
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def cmd_demo(args):
    backend = args.backend if args.backend != "auto" else best_backend()
    if backend == "cuda":
        import cupy as xp
        b, h, n, d, dtype = 4, 16, 4096, 64, np.float16
    else:
        xp = np
        b, h, n, d, dtype = 1, 8, 2048, 64, np.float32
    if args.n:
        n = args.n
    if backend == "emulator":  # the same CUDA kernels, run on the CPU: keep it small
        b, h, n = 1, 2, min(n, 256)
    print(f"cuflash demo on backend {backend!r}: causal self-attention, "
          f"B={b} H={h} N={n} d={d} {np.dtype(dtype)}")
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(4)]
    q, k, v, do = (xp.asarray(a) for a in host)

    def forward():
        return cuflash.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)

    def backward(o, lse):
        return cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True,
                                                backend=backend)

    t0 = time.perf_counter()
    with _Meter(backend) as meter:  # first call: compiles (or loads) kernels, warms up
        o, lse = forward()
        dq, dk, dv = backward(o, lse)
        _sync(backend)
        peak = meter.peak()
    print(f"  first forward+backward (compiles or loads the kernels): "
          f"{time.perf_counter() - t0:.2f} s")
    t_fwd, t_bwd = [], []
    for _ in _progress(range(args.repeat), desc="timing", unit="run"):
        t0 = time.perf_counter()
        o, lse = forward()
        _sync(backend)
        t_fwd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dq, dk, dv = backward(o, lse)
        _sync(backend)
        t_bwd.append(time.perf_counter() - t0)
    t_fwd, t_bwd = float(np.median(t_fwd)), float(np.median(t_bwd))
    in_bytes = sum(a.nbytes for a in host)
    naive = b * h * n * n * np.dtype(np.float32).itemsize
    for what, t, pass_ in (("forward", t_fwd, "fwd"), ("backward", t_bwd, "bwd")):
        gflops = attention_flops(b, h, n, n, d, causal=True, pass_=pass_) / t / 1e9
        print(f"  {what:9s} {significant(t * 1e3):>9s} ms  {significant(gflops):>8s} GFLOP/s  "
              f"(median of {args.repeat})")
    print(f"  peak memory beyond inputs: {peak / 2**20:.1f} MiB for fwd+bwd outputs and "
          f"work space (inputs {in_bytes / 2**20:.1f} MiB; a naive score matrix alone "
          f"would take {naive / 2**20:.1f} MiB)")

    # Check every head against the float64 reference, one head at a time.
    get = (lambda a: a.get()) if backend == "cuda" else np.asarray
    outputs = [get(a) for a in (o, lse, dq, dk, dv)]
    heads = [(i, j) for i in range(b) for j in range(h)][: args.check_heads]
    worst = _worst_error(host, outputs, _progress(heads, desc="checking against the reference",
                                                  unit="head"), causal=True)
    tol = _tolerance(dtype)
    ok = all(e <= tol for e in worst.values())
    print(f"  checked {len(heads)} head(s) against the float64 reference: max relative error "
          + ", ".join(f"{k} {e:.1e}" for k, e in worst.items())
          + f" -> {'OK' if ok else 'FAILED'} (tolerance {tol:g})")
    return 0 if ok else 1


# -- bench ------------------------------------------------------------------------------

# Sequence lengths and dtype by backend: seconds per configuration, not hours, on each.
BENCH_N = {"cuda": (1024, 2048, 4096, 8192), "numpy": (512, 1024, 2048),
           "emulator": (32, 64, 128)}
BENCH_DTYPE = {"cuda": "float16", "numpy": "float32", "emulator": "float32"}
BENCH_FIELDS = ("backend", "dtype", "batch", "heads", "n", "d", "causal", "pass",
                "ms_median", "ms_best", "gflops", "max_rel_err")


def bench_out_dir():
    """benchmarks/results when run from a directory with a benchmarks/ folder (the cuflash
    repository), else the current directory."""
    here = pathlib.Path.cwd()
    return here / "benchmarks" / "results" if (here / "benchmarks").is_dir() else here


def _timings(f, repeat, backend):
    """Seconds of `repeat` calls of `f` after one warm-up call."""
    f()
    _sync(backend)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        _sync(backend)
        ts.append(time.perf_counter() - t0)
    return np.array(ts)


def cmd_bench(args):
    backend = args.backend if args.backend != "auto" else best_backend()
    xp = np
    if backend == "cuda":
        import cupy as xp
    dtype = np.dtype(args.dtype or BENCH_DTYPE[backend])
    ns = args.n or BENCH_N[backend]
    b, h, d = args.batch, args.heads, args.d
    out = pathlib.Path(args.out) if args.out else bench_out_dir()
    print(f"cuflash bench on {backend!r}: B={b} H={h} d={d} {dtype}, median of {args.repeat} "
          f"runs after a warm-up, each size first checked against the float64 reference; "
          f"GFLOP/s by FlashAttention's count: forward 4·B·H·N²·d, halved when causal, "
          f"backward 2.5× forward")
    print(f"{'N':>6} {'causal':>6} {'fwd ms':>10} {'fwd GFLOP/s':>12} {'bwd ms':>10} "
          f"{'bwd GFLOP/s':>12} {'max rel err':>11}")
    get = (lambda a: a.get()) if backend == "cuda" else np.asarray
    tol = _tolerance(dtype)
    rng = np.random.default_rng(0)
    rows, ok = [], True
    for n in ns:
        host = [rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(4)]
        q, k, v, do = (xp.asarray(a) for a in host)
        for causal in (False, True):
            def fwd():
                return cuflash.flash_attention(q, k, v, causal=causal, return_lse=True,
                                               backend=backend)
            o, lse = fwd()

            def bwd():
                return cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                        backend=backend)
            # validate first (one head against the float64 reference), then time
            err = max(_worst_error(host, [get(a) for a in (o, lse, *bwd())], [(0, 0)],
                                   causal).values())
            ok &= err <= tol
            cells = []
            for pass_, f in (("fwd", fwd), ("bwd", bwd)):
                ts = _timings(f, args.repeat, backend)
                ms = float(np.median(ts)) * 1e3
                gflops = attention_flops(b, h, n, n, d, causal=causal, pass_=pass_) / ms / 1e6
                rows.append({"backend": backend, "dtype": dtype.name, "batch": b, "heads": h,
                             "n": n, "d": d, "causal": causal, "pass": pass_,
                             "ms_median": ms, "ms_best": float(np.min(ts)) * 1e3,
                             "gflops": gflops, "max_rel_err": err})
                cells += [significant(ms), significant(gflops)]
            print(f"{n:>6} {str(causal):>6} {cells[0]:>10} {cells[1]:>12} {cells[2]:>10} "
                  f"{cells[3]:>12} {err:>11.1e}" + ("" if err <= tol else "  FAILED"))
    stem = out / f"bench_{backend}_{dtype.name}"
    out.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, BENCH_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {stem.with_suffix('.csv')}")
    _plot(rows, stem.with_suffix(".png"), f"cuflash on {backend}: B={b} H={h} d={d} {dtype}")
    if not ok:
        print(f"FAILED: an error above the tolerance {tol:g}")
    return 0 if ok else 1


def _plot(rows, path, title):
    """GFLOP/s over N, one line per pass and masking; nothing without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'cuflash[cli]')")
        return
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for pass_ in ("fwd", "bwd"):
        for causal in (False, True):
            pts = [(r["n"], r["gflops"]) for r in rows
                   if r["pass"] == pass_ and r["causal"] == causal]
            ax.plot(*zip(*pts), marker="o",
                    label=f"{'forward' if pass_ == 'fwd' else 'backward'}"
                          f"{', causal' if causal else ''}")
    ax.set_xscale("log", base=2)
    ns = sorted({r["n"] for r in rows})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title)
    ax.legend()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -- check-kernels ----------------------------------------------------------------------

def cmd_check_kernels(args):
    from .compile_gate import check_kernels
    return check_kernels(args.gate_args)


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, unless the help states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default:" in text else super()._get_help_string(action)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=cuflash.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", formatter_class=_Defaults,
                          help="device, backends and the kernels each GPU runs (tile plans)",
                          description="The device, the backends, and the tile plans of the "
                                      "local GPU or of --arch: the kernel each dtype and head "
                                      "dim takes, why, and its blocks per SM.")
    info.add_argument("--arch", action="append", default=None, metavar="sm_XY",
                      help="list this architecture's plans, repeatable (default: the local GPU's)")
    info.add_argument("--verbose", "-v", action="store_true",
                      help="list the plans of every architecture the compile gate builds")
    demo = sub.add_parser("demo", formatter_class=_Defaults,
                          help="attention at realistic sizes on the best backend, checked "
                               "against the reference, with time and memory")
    demo.add_argument("--backend", default="auto", choices=cuflash.api.BACKENDS,
                      help="where to run (auto: cuda where CuPy sees a GPU, else numpy)")
    demo.add_argument("--n", type=int, default=None,
                      help="sequence length (default: 4096 on cuda, 2048 on numpy, 256 on the "
                           "emulator)")
    demo.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
    demo.add_argument("--check-heads", type=int, default=4,
                      help="how many heads to check against the float64 reference")
    bench = sub.add_parser(
        "bench", formatter_class=_Defaults,
        help="forward and backward time and GFLOP/s over N: a table, a CSV and a plot",
        description="Times cuflash's forward and backward (causal and not) over sequence "
                    "lengths after checking each size against the float64 reference; prints "
                    "a table and writes bench_<backend>_<dtype>.csv and, with matplotlib, "
                    ".png. GFLOP/s by FlashAttention's count (cuflash.flops).")
    bench.add_argument("--backend", default="auto", choices=cuflash.api.BACKENDS,
                       help="where to run (auto: cuda where CuPy sees a GPU, else numpy)")
    bench.add_argument("--n", type=int, nargs="+", default=None,
                       help="sequence lengths (default: " + "; ".join(
                           f"{k} {' '.join(map(str, v))}" for k, v in BENCH_N.items()) + ")")
    bench.add_argument("--batch", type=int, default=1, help="batch size B")
    bench.add_argument("--heads", type=int, default=8, help="heads H")
    bench.add_argument("--d", type=int, default=64, help="head dim")
    bench.add_argument("--dtype", default=None, choices=[dt.name for dt in _dtypes.SUPPORTED],
                       help="input dtype (default: " + ", ".join(
                           f"{v} on {k}" for k, v in BENCH_DTYPE.items()) + ")")
    bench.add_argument("--repeat", type=int, default=5, help="timed runs per pass (median)")
    bench.add_argument("--out", default=None, metavar="DIR",
                       help="where the CSV and the plot go (default: benchmarks/results when run "
                            "from a directory with a benchmarks/ folder, as the cuflash "
                            "repository's root, else the current directory)")
    # check-kernels has its own options (compile_gate.check_kernels parses them).
    from .compile_gate import ARCHS
    sub.add_parser("check-kernels", add_help=False,
                   help="compile every kernel specialization with NVRTC + ptxas for "
                        f"{', '.join(ARCHS)}: registers, shared memory, spills "
                        "(check-kernels --help for its options)")
    return parser


def main(argv=None):
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "check-kernels":
        args.gate_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        from .emulator import archs
        known = [a for a, x in archs.ARCHS.items() if not x.specific]   # sm_90a runs sm_90's plans
        for arch in args.arch or ():
            if arch not in known:
                parser.error(f"info --arch: got {arch!r}; choose from {', '.join(known)}")
    for name in ("n", "batch", "heads", "d", "repeat", "check_heads"):
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:
                parser.error(f"{args.command} --{name.replace('_', '-')}: got {value}; "
                             "a positive integer is needed")
    commands = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench,
                "check-kernels": cmd_check_kernels}
    return commands[args.command](args)
