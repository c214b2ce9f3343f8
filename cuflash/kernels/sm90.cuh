// sm90.cuh — Hopper's asynchronous machinery (sm_90a) as small device functions: mbarriers,
// tensor copies (TMA), warpgroup MMA (wgmma) and its shared-memory descriptors. Each wraps
// one PTX instruction as the PTX ISA specifies it; the CPU emulator runs the same PTX.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sm90 {

// A CUtensorMap: 128 opaque bytes made on the host (the driver's cuTensorMapEncodeTiled, or
// cuflash.emulator.tma.encode_tiled), passed as a `const __grid_constant__` parameter.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// ---- mbarrier: a phase completes when every arrival and every announced byte has come ----
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(bar)) : "memory");
}
// arrive, announcing `bytes` that copies will complete in this phase
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(bar)), "r"(bytes) : "memory");
}
// wait until the phase of parity `parity` has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\n WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}" :: "r"(smem(bar)), "r"(parity) : "memory");
}

// ---- named barriers (id 1..15; 0 is __syncthreads): `count` threads, whole warps, meet ----
__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// ---- this thread's warpgroup (threadIdx.x / 128), known to be the same across the warp (a
// shuffle from lane 0): what is made from it, such as a consumer's wgmma descriptors of its
// rows, then stays in uniform registers instead of moving there before every wgmma ----
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// ---- the descriptors of an operand fixed for a whole loop, one per k16 step ----
// desc + (k / 4) * box + 2 * (k % 4) (k steps of 32 bytes, the next box `box` on). With
// kHold each passes through a shuffle, which hides that it is desc plus a constant: ptxas
// then holds it (2 uniform registers) rather than remake it at every product. Whether that
// pays is the gate's count to tell: the forward's 8 at D <= 128 do under both toolkits, its
// 16 at D = 256 spill, and the backward's K_j, V_j (dK/dV) or Q_i, dO_i (dQ) saved 5-9
// instructions per step under CUDA 12.9 but cost 6-8 more under 13.5, so it holds none.
template <bool kHold, int N>
__device__ __forceinline__ void k_step_descs(unsigned long long (&d)[N], unsigned long long desc,
                                             unsigned box) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        d[k] = desc + (k / 4) * box + 2 * (k % 4);
        if constexpr (kHold) d[k] = __shfl_sync(0xffffffffu, d[k], 0);
    }
}

// ---- one elected lane of the warp ----
__device__ __forceinline__ bool elect_one() {
    unsigned leader, elected;
    asm volatile("{\n .reg .pred p;\n elect.sync %0|p, 0xffffffff;\n selp.u32 %1, 1, 0, p;\n}"
                 : "=r"(leader), "=r"(elected));
    return elected;
}

// ---- registers between the warpgroups of a block ----
template <int N> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N)); }
template <int N> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N)); }

// ---- A ring of STAGES shared-memory slots between one producer thread and `consumers`
// threads: slot s's "full" mbarrier takes the producer's arrival and the copies' bytes, its
// "empty" one the consumers' arrivals. Step `it` uses slot it % STAGES in phase
// (it / STAGES) & 1; the producer reuses a slot once its previous step was released ----
template <int STAGES> struct Ring {
    unsigned long long full[STAGES], empty[STAGES];

    // by one thread, then fenced; `producers`: the threads that fill a slot (one that starts
    // copies, or those that write it themselves)
    __device__ __forceinline__ void init(int consumers, int producers = 1) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], producers);
            mbar_init(&empty[s], consumers);
        }
    }
    // a producer: until step it's slot is free
    __device__ __forceinline__ void wait_free(int it) {
        if (it >= STAGES) mbar_wait(&empty[it % STAGES], (it / STAGES - 1) & 1);
    }
    // the producer: waits until step it's slot is free, announces `bytes` of copies; returns
    // the mbarrier those copies complete on
    __device__ __forceinline__ unsigned long long* acquire(int it, unsigned bytes) {
        wait_free(it);
        mbar_arrive_expect_tx(&full[it % STAGES], bytes);
        return &full[it % STAGES];
    }
    // a producer that writes the slot itself: done with step it's (its writes fenced for the
    // async proxy first, where wgmma reads them)
    __device__ __forceinline__ void fill(int it) { mbar_arrive(&full[it % STAGES]); }
    // a consumer: until step it's copies have landed; then, done with them
    __device__ __forceinline__ void wait(int it) { mbar_wait(&full[it % STAGES], (it / STAGES) & 1); }
    __device__ __forceinline__ void release(int it) { mbar_arrive(&empty[it % STAGES]); }

    // A step's slot and phase, carried from step to step (one compare and select, no
    // division), for a loop that walks the steps in order
    struct Pos {
        unsigned slot, phase;
        __device__ __forceinline__ void advance() {
            if (++slot == STAGES) {
                slot = 0;
                phase ^= 1;
            }
        }
    };
    __device__ __forceinline__ static Pos at(int it) { return {unsigned(it % STAGES), unsigned(it / STAGES) & 1}; }
    __device__ __forceinline__ void wait(Pos p) { mbar_wait(&full[p.slot], p.phase); }
    __device__ __forceinline__ void release(Pos p) { mbar_arrive(&empty[p.slot]); }
};

// ---- TMA: fetch tensor maps (__grid_constant__ parameters) into the descriptor cache ahead
// of their first copies, as the block starts ----
template <class... Maps> __device__ __forceinline__ void prefetch_tensormaps(const Maps&... maps) {
    const void* const each[] = {&maps...};
#pragma unroll
    for (const void* map : each) asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}

// ---- TMA: a 2-D box at (c0 innermost, c1) into shared memory, completing bytes on `bar` ----
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(smem(bar)) : "memory");
}

// ---- the same for a 4-D box at (c0 innermost, c1, c2, c3) ----
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, int c0, int c1, int c2,
                                            int c3, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(smem(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem(bar))
                 : "memory");
}

// ---- a 4-D box of shared memory at `src` to the tensor at (c0, c1, c2, c3) (rows outside
// the tensor are dropped); the thread's bulk group, committed and waited for as below ----
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, int c0, int c1, int c2, int c3,
                                             const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 :: "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem(src)) : "memory");
}
// The `bytes` of floats at src (shared) added to those at dst (global) in one asynchronous
// operation, as atomics: committed and waited for as bulk stores are
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// until the committed stores have read their shared memory
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// until the committed stores and reduce-adds have completed (their writes made)
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Four 8x8 matrices of 16-bit values stored from the warp's mma fragments (register i: row
// lane / 4, columns 2 (lane % 4) .. of matrix i); lane l gives the address of matrix l / 8's
// row l % 8 (shared, 16 bytes)
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// the thread's generic writes of shared memory, before the async proxy (a TMA store) reads them
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- wgmma ----
// The descriptor of a K-major operand tile in 128-byte-swizzled rows (the layout a TMA box of
// 128-byte rows with CU_TENSOR_MAP_SWIZZLE_128B leaves): 8-row atoms 1024 bytes apart (SBO),
// LBO unused; the tile must start on a 1024-byte boundary, k steps add 32 bytes.
__device__ __forceinline__ unsigned long long desc_k_major_sw128(const void* tile) {
    return (unsigned long long)((smem(tile) & 0x3ffff) >> 4) | 1ull << 16 | (1024ull >> 4) << 32 | 1ull << 62;
}
// The descriptor of an MN-major operand tile (B of P̃·V: V's rows of 64 head-dim elements,
// 128 bytes, along K) in 128-byte-swizzled rows, as a TMA box of 128-byte rows leaves it:
// 8-row groups along K 1024 bytes apart (SBO), the next 64 elements of N `lbo` bytes on (the
// next box); k16 steps add 2048 bytes.
__device__ __forceinline__ unsigned long long desc_mn_major_sw128(const void* tile, unsigned lbo) {
    return (unsigned long long)((smem(tile) & 0x3ffff) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (1024ull >> 4) << 32 | 1ull << 62;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// wgmma's accumulator operands, N / 2 f32 registers per thread of an m64nN tile (an asm
// statement takes literal strings: macros, one per N)
#define SM90_ACC16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SM90_ACC16_OUT(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define SM90_ACC32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SM90_ACC32_OUT(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SM90_ACC64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SM90_ACC64_OUT(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// T: __half or __nv_bfloat16, wgmma's .f16 or .bf16 operands
template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// One wgmma statement per shape, its operand type (TY: "f16" or "bf16") spliced into the
// string: T = __half or __nv_bfloat16 picks which of the two the wrappers below issue
#define SM90_WGMMA(TY, SHAPE, SCALE, ACC, OPERANDS, IMMS, ACC_OUT, D, ...)               \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" SCALE ", 0;\n"                  \
                 " wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY "\n"             \
                 " " ACC ", " OPERANDS ", p, " IMMS ";\n}"                                 \
                 : ACC_OUT(D) : __VA_ARGS__)
#define SM90_WGMMA_T(T, ...)                                                                \
    do {                                                                                    \
        if constexpr (IsBf16<T>::value) SM90_WGMMA("bf16", __VA_ARGS__);                    \
        else SM90_WGMMA("f16", __VA_ARGS__);                                                \
    } while (0)

// D (64 x N, f32: this thread's N / 2 accumulators) += A (64 x 16) · B (16 x N), both from
// shared memory, K-major; scale_d = 0: D = A·B; N = 128 or 64
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], unsigned long long a,
                                                    unsigned long long b, int scale_d) {
    SM90_WGMMA_T(T, "m64n128k16", "66", SM90_ACC64, "%64, %65", "1, 1, 0, 0", SM90_ACC64_OUT, d,
                 "l"(a), "l"(b), "r"(scale_d));
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], unsigned long long a,
                                                   unsigned long long b, int scale_d) {
    SM90_WGMMA_T(T, "m64n64k16", "34", SM90_ACC32, "%32, %33", "1, 1, 0, 0", SM90_ACC32_OUT, d,
                 "l"(a), "l"(b), "r"(scale_d));
}

// The same, A and B both MN-major (imm-trans-a, imm-trans-b = 1): A's 16-bit rows along M
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss_tt(float (&d)[32], unsigned long long a,
                                                      unsigned long long b, int scale_d) {
    SM90_WGMMA_T(T, "m64n64k16", "34", SM90_ACC32, "%32, %33", "1, 1, 1, 1", SM90_ACC32_OUT, d,
                 "l"(a), "l"(b), "r"(scale_d));
}

// D (64 x N, f32) += A (64 x 16 from registers: each warp's 16 rows as mma.sync's A
// fragment) · B (16 x N) from shared memory, MN-major (imm-trans-b = 1); N = 64 or 128
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4],
                                                   unsigned long long b, int scale_d) {
    SM90_WGMMA_T(T, "m64n64k16", "37", SM90_ACC32, "{%32, %33, %34, %35}, %36", "1, 1, 1",
                 SM90_ACC32_OUT, d, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4],
                                                    unsigned long long b, int scale_d) {
    SM90_WGMMA_T(T, "m64n128k16", "69", SM90_ACC64, "{%64, %65, %66, %67}, %68", "1, 1, 1",
                 SM90_ACC64_OUT, d, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// tf32: float32 operands, of which wgmma reads the upper 19 bits (m64nNk8, both operands
// K-major: no transposed form)
__device__ __forceinline__ void wgmma_m64n64k8_ss_tf32(float (&d)[32], unsigned long long a,
                                                       unsigned long long b, int scale_d) {
    SM90_WGMMA("tf32", "m64n64k8", "34", SM90_ACC32, "%32, %33", "1, 1", SM90_ACC32_OUT, d,
               "l"(a), "l"(b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_m64n32k8_ss_tf32(float (&d)[16], unsigned long long a,
                                                       unsigned long long b, int scale_d) {
    SM90_WGMMA("tf32", "m64n32k8", "18", SM90_ACC16, "%16, %17", "1, 1", SM90_ACC16_OUT, d,
               "l"(a), "l"(b), "r"(scale_d));
}
// D (64 x N) += A (64 x 8 from registers, mma.sync's tf32 A fragment) · B (8 x N, K-major)
__device__ __forceinline__ void wgmma_m64n64k8_rs_tf32(float (&d)[32], const unsigned (&a)[4],
                                                       unsigned long long b, int scale_d) {
    SM90_WGMMA("tf32", "m64n64k8", "37", SM90_ACC32, "{%32, %33, %34, %35}, %36", "1, 1",
               SM90_ACC32_OUT, d, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_m64n128k8_rs_tf32(float (&d)[64], const unsigned (&a)[4],
                                                        unsigned long long b, int scale_d) {
    SM90_WGMMA("tf32", "m64n128k8", "69", SM90_ACC64, "{%64, %65, %66, %67}, %68", "1, 1",
               SM90_ACC64_OUT, d, "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

}  // namespace sm90
