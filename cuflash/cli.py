"""`python -m cuflash`: info, demo, bench, check-kernels."""
import argparse
import platform
import shutil
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

def cmd_info(args):
    print(f"cuflash {cuflash.__version__} on Python {platform.python_version()}, "
          f"NumPy {np.__version__}")
    print(f"dtypes: {_dtypes.SUPPORTED_NAMES}"
          + ("" if _dtypes.BFLOAT16 is not None else " (bfloat16 needs ml_dtypes)"))
    cupy, dev = _gpu()
    print("backends:")
    from .backends import numpy_backend
    print(f"  numpy     available (blocked FlashAttention-2 on the CPU, "
          f"{numpy_backend.BACKEND.config.workers} workers, exponentials in base "
          f"{numpy_backend.BACKEND.config.base.name}: NumPy's fastest on this CPU)")
    gxx = shutil.which("g++")
    print(f"  emulator  {'available, g++ at ' + gxx if gxx else 'needs g++ (apt-get install g++)'}")
    if cupy is None:
        print(f"  cuda      unavailable: {dev}")
        _plans_per_arch()
        return 0
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"  cuda      {name}, compute capability {dev.compute_capability}, "
          f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    from . import tiling
    limits = tiling.device_limits()
    print(f"tile plans for this device ({limits}):")
    for dtype in _dtypes.SUPPORTED:
        for d in (64, 128, 256):
            try:
                fwd, why = tiling.forward_path(d, dtype, limits["cc"], max_smem=limits["max_smem"])
                (dkdv, dq), bwd_why = tiling.backward_path(d, dtype, **limits)
                print(f"  {str(dtype):9s} d={d:<4d} forward {fwd}\n{'':19s}path: {why}"
                      f"\n{'':19s}backward {dkdv}; {dq}\n{'':19s}path: {bwd_why}")
            except ValueError as exc:
                print(f"  {str(dtype):9s} d={d:<4d} no plan: {exc}")
    fwd, _ = tiling.forward_path(128, np.float16, limits["cc"], max_smem=limits["max_smem"])
    print(f"  {_split_kv_example(fwd, limits['sm_count'])}")
    return 0


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


def _plans_per_arch():
    """The kernels each gate architecture would run, and their predicted occupancy."""
    from . import compile_gate, compiler, tiling
    from .emulator import archs
    print("plans per architecture (forward and backward kernels, why, and blocks and warps "
          "per SM by the occupancy calculator's rules with the compile gate's registers):")
    unknown = False
    for arch in compiler.GATE_ARCHS:
        a = archs.get_arch(arch)
        limits = {"max_smem": a.limits.shared_per_block_optin, "sm_count": a.limits.sm_count}
        cc = divmod(a.cuda_arch // 10, 10)
        registers = compile_gate.cached_registers(arch)

        def occupancy(plan):
            nonlocal unknown
            regs = registers.get(plan.name_expression)
            if regs is None:
                unknown = True
                return "occupancy ?"
            blocks = tiling.occupancy(a.limits, threads=plan.num_threads,
                                      smem_bytes=plan.smem_bytes, registers=regs)
            warps = blocks * -(-plan.num_threads // 32)
            return f"{blocks} block{'s' * (blocks != 1)}, {warps} warps per SM"

        print(f"  {arch} ({a.limits.gpu}):")
        for dtype in (dt for dt in _dtypes.SUPPORTED if dt.itemsize < 8):
            for d in (64, 128, 256):
                fwd, why = tiling.forward_path(d, dtype, cc, **limits)
                bwd, bwd_why = tiling.backward_path(d, dtype, cc, **limits)
                print(f"    {str(dtype):9s} d={d:<4d} forward  {fwd.name_expression:52s} "
                      f"{occupancy(fwd)}\n{'':24s}{why}")
                for plan in bwd:
                    print(f"{'':20s}backward {plan.name_expression:52s} {occupancy(plan)}")
                print(f"{'':24s}{bwd_why}")
        decode_plan = tiling.forward_path(128, np.float16, cc, **limits)[0]
        print(f"    {_split_kv_example(decode_plan, a.limits.sm_count)}")
    if unknown:
        print("  occupancy ?: registers not in the gate's cache; run "
              "`python -m cuflash check-kernels` once")
    print("  Blackwell (sm_100, sm_120) is not in the gate: CuPy compiles the sm_90 plans "
          "for it where the installed NVRTC targets it (CUDA 12.8 and later).")


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
        print(f"  {what:9s} {t * 1e3:9.1f} ms  {gflops:8.1f} GFLOP/s  (median of {args.repeat})")
    print(f"  peak memory beyond inputs: {peak / 2**20:.1f} MiB for fwd+bwd outputs and "
          f"work space (inputs {in_bytes / 2**20:.1f} MiB; a naive score matrix alone "
          f"would take {naive / 2**20:.1f} MiB)")

    # Check every head against the float64 reference, one head at a time.
    get = (lambda a: a.get()) if backend == "cuda" else np.asarray
    o, lse, dq, dk, dv = map(get, (o, lse, dq, dk, dv))
    worst = {"o": 0.0, "lse": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    heads = [(i, j) for i in range(b) for j in range(h)][: args.check_heads]
    for i, j in _progress(heads, desc="checking against the reference", unit="head"):
        qh, kh, vh, doh = (a[i, j] for a in host)
        ro, rlse = reference.naive_attention(qh, kh, vh, causal=True, return_lse=True)
        grads = reference.attention_backward(doh, qh, kh, vh, ro, rlse, causal=True)
        for name, got, ref in (("o", o, ro), ("lse", lse, rlse), ("dq", dq, grads[0]),
                               ("dk", dk, grads[1]), ("dv", dv, grads[2])):
            err = np.max(np.abs(got[i, j].astype(np.float64) - ref))
            worst[name] = max(worst[name], float(err / max(1.0, np.max(np.abs(ref)))))
    tol = 1e-4 if np.dtype(dtype).itemsize >= 4 else 3e-2
    ok = all(e <= tol for e in worst.values())
    print(f"  checked {len(heads)} head(s) against the float64 reference: max relative error "
          + ", ".join(f"{k} {e:.1e}" for k, e in worst.items())
          + f" -> {'OK' if ok else 'FAILED'} (tolerance {tol:g})")
    return 0 if ok else 1


# -- bench ------------------------------------------------------------------------------

def cmd_bench(args):
    backend = args.backend if args.backend != "auto" else best_backend()
    xp = np
    if backend == "cuda":
        import cupy as xp
    dtype = np.dtype(args.dtype)
    print(f"cuflash bench on {backend!r}: B={args.batch} H={args.heads} d={args.d} {dtype}, "
          f"median of {args.repeat}; FLOPs 4·B·H·N²·d (halved causal), backward ×2.5")
    print(f"{'N':>6} {'causal':>6} {'fwd ms':>9} {'fwd GFLOP/s':>12} {'bwd ms':>9} "
          f"{'bwd GFLOP/s':>12}")
    rng = np.random.default_rng(0)
    for n in args.n:
        shape = (args.batch, args.heads, n, args.d)
        q, k, v, do = (xp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
        for causal in (False, True):
            def fwd():
                return cuflash.flash_attention(q, k, v, causal=causal, return_lse=True,
                                               backend=backend)
            o, lse = fwd()

            def bwd():
                return cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                        backend=backend)
            times = []
            for f in (fwd, bwd):
                f()
                _sync(backend)
                ts = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    f()
                    _sync(backend)
                    ts.append(time.perf_counter() - t0)
                times.append(float(np.median(ts)))
            fl = [attention_flops(args.batch, args.heads, n, n, args.d, causal=causal, pass_=p)
                  for p in ("fwd", "bwd")]
            print(f"{n:>6} {str(causal):>6} {times[0] * 1e3:9.2f} {fl[0] / times[0] / 1e9:12.1f} "
                  f"{times[1] * 1e3:9.2f} {fl[1] / times[1] / 1e9:12.1f}")
    return 0


# -- check-kernels ----------------------------------------------------------------------

def cmd_check_kernels(args):
    from .compile_gate import check_kernels
    return check_kernels(args.gate_args)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=cuflash.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, memory, tile plans and available backends")
    demo = sub.add_parser("demo", help="attention at realistic sizes on the best backend, "
                          "checked against the reference, with time and memory")
    demo.add_argument("--backend", default="auto", choices=cuflash.api.BACKENDS)
    demo.add_argument("--n", type=int, default=None, help="sequence length")
    demo.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
    demo.add_argument("--check-heads", type=int, default=4,
                      help="how many heads to check against the float64 reference")
    bench = sub.add_parser("bench", help="forward/backward time and GFLOP/s over N")
    bench.add_argument("--backend", default="auto", choices=cuflash.api.BACKENDS)
    bench.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048])
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--heads", type=int, default=8)
    bench.add_argument("--d", type=int, default=64)
    bench.add_argument("--dtype", default="float32")
    bench.add_argument("--repeat", type=int, default=5)
    # check-kernels has its own options (compile_gate.check_kernels parses them).
    sub.add_parser("check-kernels", add_help=False,
                   help="compile every kernel specialization with NVRTC + ptxas for "
                        "sm_70..sm_90: registers, shared memory, spills")
    args, rest = parser.parse_known_args(argv)
    if args.command == "check-kernels":
        args.gate_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    commands = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench,
                "check-kernels": cmd_check_kernels}
    return commands[args.command](args)
