#!/usr/bin/env python3
"""Record tensor-core block dot products on the GPU at hand, in the format of
tests/data/tensor-core (GPU/format/{a,b,c,d}.txt), so that the emulator's arithmetic model is
confirmed or corrected by the first run on each GPU: `mma.sync` (m16n8k16 fp16/bf16, m16n8k8
tf32) everywhere from sm_80, and on sm_90 Hopper's `wgmma.mma_async` (m64n8k16 fp16/bf16,
m64n8k8 tf32), whose sums the emulator assumes to follow mma.sync's.

Each sample is one dot product d = a·b + c of K = 16 (fp16, bf16) or 8 (tf32) products, drawn
to stress the alignment: operands of random sign with exponents spread over a wide range,
and a random accumulator. A launch puts 8 samples on the diagonal of each problem (row r of A,
column r of B, C[r, r]); every other element is zero, which does not change a block's sum.

  python3 tools/capture_tensor_cores.py --out benchmarks/results/tensor-core
  python3 tools/capture_tensor_cores.py --emulator sm_90a --out /tmp/x   # the plumbing, no GPU

Writes OUT/<instruction>-<GPU>/<format>/{a,b,c,d}.txt and prints one line per capture. Replay
a capture with the emulator: tests/test_emulator_ptx.py (mma.sync) and
tests/test_emulator_sm90.py (wgmma) read every capture under tests/data/tensor-core.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FORMATS = {"fp16": ("f16", 16), "bf16": ("bf16", 16), "tf32": ("tf32", 8)}

KERNELS = r"""
// one m16n8k16 (f16/bf16) or m16n8k8 (tf32) mma.sync per warp: A 16 x K row-major, B K x 8
// column-major (n-th column contiguous), C and D 16 x 8 row-major, all as 32-bit patterns
// (16-bit formats in the low half)
template <int KIND>
__global__ void mma_capture(const unsigned* A, const unsigned* B, const unsigned* C, unsigned* D) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const long p = blockIdx.x;
    A += p * 16 * (KIND == 2 ? 8 : 16); B += p * 8 * (KIND == 2 ? 8 : 16); C += p * 128; D += p * 128;
    unsigned a[4], b[2], c[4], d[4];
    if (KIND == 2) {   // tf32: a0 (g,t) a1 (g+8,t) a2 (g,t+4) a3 (g+8,t+4); b0 (t,g) b1 (t+4,g)
        for (int i = 0; i < 4; ++i) a[i] = A[(g + 8 * (i & 1)) * 8 + t + 4 * (i >> 1)];
        for (int i = 0; i < 2; ++i) b[i] = B[g * 8 + t + 4 * i];
    } else {           // a_i: k 2t, 2t+1 (+8 for i >= 2) of row g (+8 for odd i); b_i: k 2t, 2t+1 (+8)
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i & 1), k = 2 * t + 8 * (i >> 1);
            a[i] = (A[row * 16 + k] & 0xffff) | A[row * 16 + k + 1] << 16;
        }
        for (int i = 0; i < 2; ++i) {
            const int k = 2 * t + 8 * i;
            b[i] = (B[g * 16 + k] & 0xffff) | B[g * 16 + k + 1] << 16;
        }
    }
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    if (KIND == 0)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%10,%11,%12,%13};" : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
    else if (KIND == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%10,%11,%12,%13};" : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
    else
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%10,%11,%12,%13};" : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = d[i];
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
// one m64n8k16 (f16/bf16) or m64n8k8 (tf32) wgmma per block of 128 threads, A (64 x K) and B
// (8 x K) K-major in shared memory without swizzle (8-row core matrices of 16 bytes: LBO 128
// bytes between K chunks, SBO between 8-row groups), C and D 64 x 8 row-major
template <int KIND>
__global__ void wgmma_capture(const unsigned* A, const unsigned* B, const unsigned* C, unsigned* D) {
    constexpr int K = KIND == 2 ? 8 : 16, E = KIND == 2 ? 4 : 2, T = 16 / E;
    __shared__ __align__(128) unsigned char sa[64 * K * E], sb[8 * K * E];
    const long p = blockIdx.x;
    A += p * 64 * K; B += p * 8 * K; C += p * 512; D += p * 512;
    for (int i = threadIdx.x; i < 64 * K; i += 128) {   // element (m, k) of a K-major core-matrix layout
        const int m = i / K, k = i % K, off = (m / 8) * (K / T) * 128 + (k / T) * 128 + (m % 8) * 16 + (k % T) * E;
        const unsigned v = A[i];
        for (int b = 0; b < E; ++b) sa[off + b] = (unsigned char)(v >> 8 * b);
    }
    for (int i = threadIdx.x; i < 8 * K; i += 128) {
        const int n = i / K, k = i % K, off = (k / T) * 128 + n * 16 + (k % T) * E;
        const unsigned v = B[i];
        for (int b = 0; b < E; ++b) sb[off + b] = (unsigned char)(v >> 8 * b);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const unsigned long long lbo = 128 >> 4, sbo_a = (K / T) * 128 >> 4;
    const unsigned long long da = ((__cvta_generic_to_shared(sa) & 0x3ffff) >> 4) | lbo << 16 | sbo_a << 32;
    const unsigned long long db = ((__cvta_generic_to_shared(sb) & 0x3ffff) >> 4) | lbo << 16 | 128ull >> 4 << 32;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float d[4];
    for (int i = 0; i < 4; ++i) {
        const unsigned c = C[(16 * w + g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
        d[i] = __uint_as_float(c);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    if (KIND == 0)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %6, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
                     "{%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0; }"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
    else if (KIND == 1)
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %6, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0; }"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
    else
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %6, 0; wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 "
                     "{%0,%1,%2,%3}, %4, %5, p, 1, 1; }"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int i = 0; i < 4; ++i) D[(16 * w + g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = __float_as_uint(d[i]);
}
#endif
"""


def samples(fmt: str, count: int, rng) -> tuple:
    """(a, b: count x K float32 exact in `fmt`, c: count float32) spread over exponents."""
    etype, k = FORMATS[fmt]
    emin, emax = {"fp16": (-14, 6), "bf16": (-30, 30), "tf32": (-30, 30)}[fmt]
    fbits = {"fp16": 10, "bf16": 7, "tf32": 10}[fmt]

    def draw(shape):
        m = 1 + rng.integers(0, 1 << fbits, shape) / (1 << fbits)
        e = rng.integers(emin, emax + 1, shape)
        return (rng.choice([-1.0, 1.0], shape) * m * np.exp2(e)).astype(np.float32)
    a, b = draw((count, k)), draw((count, k))
    c = (rng.choice([-1.0, 1.0], count) * rng.random(count) * np.exp2(rng.integers(-20, 40, count))).astype(np.float32)
    return a, b, c


def bits_of(x: np.ndarray, fmt: str) -> np.ndarray:
    """Each element's register bits: the 16-bit pattern for fp16/bf16, float32 for tf32."""
    if fmt == "fp16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    if fmt == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint32)
    return x.view(np.uint32)


def run(module, kernel: str, fmt: str, a, b, c) -> np.ndarray:
    """d (count,) of `kernel` ("mma" or "wgmma") on the samples, 8 per problem."""
    xp = module.xp
    kind = list(FORMATS).index(fmt)
    k = FORMATS[fmt][1]
    rows = 16 if kernel == "mma" else 64
    count = a.shape[0]
    problems = -(-count // 8)
    s = np.arange(count)
    p, r = s // 8, s % 8
    A = np.zeros((problems, rows, k), np.uint32)
    B = np.zeros((problems, 8, k), np.uint32)
    C = np.zeros((problems, rows, 8), np.uint32)
    A[p, r] = bits_of(a, fmt)
    B[p, r] = bits_of(b, fmt)
    C[p, r, r] = c.view(np.uint32)
    D = xp.zeros(C.shape, xp.uint32)
    f = module.get_function(f"{kernel}_capture<{kind}>")
    f((problems,), (32 if kernel == "mma" else 128,), (xp.asarray(A), xp.asarray(B), xp.asarray(C), D))
    D = D.get() if hasattr(D, "get") else D
    return D[p, r, r]


def write(out: pathlib.Path, a, b, c, d) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, x in (("a", a), ("b", b)):
        lines = [" ".join(f"{v:08x}" for v in row) for row in x.view(np.uint32)]
        (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    for name, x in (("c", c.view(np.uint32)), ("d", d)):
        (out / f"{name}.txt").write_text("\n".join(f"{int(v):032b}" for v in x) + "\n")


class _Module:
    """The capture kernels on the GPU (CuPy) or in the emulator, with the array module to use."""

    def __init__(self, emulator_arch: str | None):
        names = [f"{k}_capture<{i}>" for k in ("mma", "wgmma") for i in range(3)]
        if emulator_arch:
            from cuflash import emulator
            self.xp, self.cc = np, divmod(emulator.get_arch(emulator_arch).cuda_arch // 10, 10)
            self.specific = emulator.get_arch(emulator_arch).specific
            self.gpu = f"emulator-{emulator_arch}"
            keep = names if self.specific else names[:3]
            self.mod = emulator.RawModule(code=KERNELS, arch=emulator_arch, name_expressions=keep)
        else:
            import cupy
            from cuflash import compiler
            dev = cupy.cuda.Device()
            self.xp, self.cc = cupy, divmod(int(dev.compute_capability), 10)
            self.specific = self.cc == (9, 0)
            name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
            self.gpu = re.sub(r"[^A-Za-z0-9]+", "-", name.decode() if isinstance(name, bytes) else name).strip("-")
            keep = names if self.specific else names[:3]
            self.mod = cupy.RawModule(code=KERNELS, name_expressions=keep,
                                      options=compiler.nvrtc_options() + compiler.arch_specific_options(self.cc))

    def get_function(self, name):
        return self.mod.get_function(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "tensor-core")
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulator", metavar="ARCH", help="run in the CPU emulator for ARCH (sm_80, sm_90a, ...)")
    args = ap.parse_args(argv)
    module = _Module(args.emulator)
    if module.cc < (8, 0):
        print(f"{module.gpu}: compute capability {module.cc[0]}.{module.cc[1]} has no bf16/tf32 mma.sync; nothing to "
              "capture", file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    for kernel in ("mma", "wgmma") if module.specific else ("mma",):
        for fmt in FORMATS:
            a, b, c = samples(fmt, args.samples, rng)
            d = run(module, kernel, fmt, a, b, c)
            target = args.out / f"{'mma.sync' if kernel == 'mma' else 'wgmma'}-{module.gpu}" / fmt
            write(target, a, b, c, d)
            print(f"{target}: {len(d)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
