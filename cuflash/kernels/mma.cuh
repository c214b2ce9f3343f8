// mma.cuh — every inline-PTX instruction cuflash uses, one small wrapper each.
//
// One `asm volatile` per PTX instruction, typed by the fragment it moves; everything above
// this header (tiles, swizzles, the softmax on fragments) is plain C++ that never sees a
// register number. The CPU emulator runs these very instructions with the PTX ISA's
// semantics (docs/emulator.md), so there is no second implementation here.
//
// The architecture is chosen here and only here (never in a kernel body):
//   sm_80+   mma.sync.m16n8k16 (f16, bf16), ldmatrix, cp.async, cvt.rn.{f16,bf16}x2.f32
//   sm_75    f16 only: one m16n8k16 step = two mma.sync.m16n8k8; ldmatrix; cp.async and
//            the packed cvt do not exist, so copies are synchronous 16-byte loads/stores
//            and the packing goes through __float2half_rn (the same rounding)
//   below    no tensor cores: TensorCores<T>::value is false and a kernel compiles to a trap
//
// Section numbers: PTX ISA 8.x, "9.7.13 Warp Level Matrix Multiply-Accumulate Instructions"
// (mma 9.7.13.4.8 "Matrix Fragments for mma.m16n8k16 with floating point type",
// 9.7.13.4.7 for m16n8k8; ldmatrix 9.7.13.4.15), "9.7.9.25 Data Movement and Conversion
// Instructions: cp.async" and "9.7.9.21 cvt".
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(__CUDA_ARCH__)
#define CUFLASH_ARCH __CUDA_ARCH__
#else
#define CUFLASH_ARCH 0
#endif

namespace cuflash {

// Which storage types run on tensor cores on the architecture being compiled.
template <typename T> struct TensorCores { static constexpr bool value = false; };
template <> struct TensorCores<__half> { static constexpr bool value = CUFLASH_ARCH >= 750; };
template <> struct TensorCores<__nv_bfloat16> { static constexpr bool value = CUFLASH_ARCH >= 800; };
template <> struct TensorCores<float> { static constexpr bool value = CUFLASH_ARCH >= 800; };  // tf32

// ---------------------------------------------------------------------------------
// Fragments of mma.m16n8k16 (f16/bf16 inputs, f32 accumulators), drawn once.
// g = lane >> 2 (the row group), t = lane % 4 (the thread in the quad).
//
//   A 16x16 (row-major, 4 x .b32 = 8 x b16; the lower column in the low half):
//       a0 = A[g    ][2t, 2t+1]     a2 = A[g    ][2t+8, 2t+9]
//       a1 = A[g + 8][2t, 2t+1]     a3 = A[g + 8][2t+8, 2t+9]
//   B 16x8 (k x n, "col": each register holds two consecutive k of one column n):
//       b0 = B[2t, 2t+1][g]         b1 = B[2t+8, 2t+9][g]
//   C, D 16x8 f32:
//       c0, c1 = C[g    ][2t, 2t+1]
//       c2, c3 = C[g + 8][2t, 2t+1]
//
//             cols 0 1 | 2 3 | 4 5 | 6 7
//       row 0      T0  | T1  | T2  | T3     ← c0 c1 of lanes 0..3   (g = 0)
//       row 1      T4  | T5  | T6  | T7
//        ...
//       row 7      T28 | T29 | T30 | T31
//       row 8      T0  | T1  | T2  | T3     ← c2 c3 of lanes 0..3
//        ...
//       row 15     T28 | T29 | T30 | T31
//
// So a quad (lanes 4g..4g+3) holds rows g and g+8 of the tile between them: a row max or
// row sum is a reduction over the quad (shuffle xor 1, 2). And the C fragments of two
// neighbouring n-tiles (cols 0-7 and 8-15) are, packed to 16 bits, exactly the A fragment
// of one k16 step: a0 = (c0, c1) and a1 = (c2, c3) of the left tile, a2, a3 of the right.
// m16n8k8 (sm_75) is the left half: A = {a0, a1}, B = {b0}.
// ---------------------------------------------------------------------------------
struct FragA { unsigned a0, a1, a2, a3; };
struct FragB { unsigned b0, b1; };
struct FragC { float c0, c1, c2, c3; };

// D = A·B + D, fp16 inputs (sm_80+).
__device__ __forceinline__ void mma_m16n8k16_f16(FragC& d, const FragA& a, const FragB& b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d.c0), "+f"(d.c1), "+f"(d.c2), "+f"(d.c3)
                 : "r"(a.a0), "r"(a.a1), "r"(a.a2), "r"(a.a3), "r"(b.b0), "r"(b.b1));
}

// D = A·B + D, bf16 inputs (sm_80+).
__device__ __forceinline__ void mma_m16n8k16_bf16(FragC& d, const FragA& a, const FragB& b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d.c0), "+f"(d.c1), "+f"(d.c2), "+f"(d.c3)
                 : "r"(a.a0), "r"(a.a1), "r"(a.a2), "r"(a.a3), "r"(b.b0), "r"(b.b1));
}

// D = A·B + D for one k8 half, fp16 inputs (sm_75+): A = {a0, a1} 16x8, B = {b0} 8x8.
__device__ __forceinline__ void mma_m16n8k8_f16(FragC& d, unsigned a0, unsigned a1, unsigned b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d.c0), "+f"(d.c1), "+f"(d.c2), "+f"(d.c3)
                 : "r"(a0), "r"(a1), "r"(b0));
}

// One k16 step, d += a·b, with the instruction the architecture has for T.
template <typename T> __device__ __forceinline__ void mma_k16(FragC& d, const FragA& a, const FragB& b);
template <> __device__ __forceinline__ void mma_k16<__half>(FragC& d, const FragA& a, const FragB& b) {
#if CUFLASH_ARCH >= 800
    mma_m16n8k16_f16(d, a, b);
#elif CUFLASH_ARCH >= 750
    mma_m16n8k8_f16(d, a.a0, a.a1, b.b0);  // k 0..7
    mma_m16n8k8_f16(d, a.a2, a.a3, b.b1);  // k 8..15
#else
    __trap();
#endif
}
template <> __device__ __forceinline__ void mma_k16<__nv_bfloat16>(FragC& d, const FragA& a, const FragB& b) {
#if CUFLASH_ARCH >= 800
    mma_m16n8k16_bf16(d, a, b);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------
// ldmatrix (sm_75+): four 8x8 b16 matrices from shared memory. Lanes 8j..8j+7 give the
// 16-byte row addresses of matrix j; register j of lane l receives of matrix j
//   non-trans:  row l>>2, cols 2(l%4), 2(l%4)+1   (an A row pair, or a B column pair of Kᵀ)
//   .trans:     rows 2(l%4), 2(l%4)+1 of col l>>2  (a B column pair of a row-major V)
// ---------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// `row` as a shared-memory address (smem_addr): the forward computes its addresses as
// 32-bit offsets once, before its main loop, and passes them on as they are.
__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            unsigned row) {
#if CUFLASH_ARCH >= 750
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(row));
#else
    __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3, unsigned row) {
#if CUFLASH_ARCH >= 750
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(row));
#else
    __trap();
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            const void* row) {
    ldmatrix_x4(r0, r1, r2, r3, smem_addr(row));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3, const void* row) {
    ldmatrix_x4_trans(r0, r1, r2, r3, smem_addr(row));
}

// ---------------------------------------------------------------------------------
// cp.async (sm_80+): 16 bytes global → shared, landing at the thread's wait_group, not at
// the issue; `valid` false reads nothing and zero-fills (src-size 0). .cg: L2 only, the
// tile is read once per block. Below sm_80 the copy is a plain synchronous 16-byte load
// and store, and commit/wait do nothing.
// ---------------------------------------------------------------------------------
// The same to a shared-memory address, reading src_size (16 or 0) bytes.
__device__ __forceinline__ void cp_async_16(unsigned smem_dst, const void* gmem_src,
                                            unsigned src_size) {
#if CUFLASH_ARCH >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(src_size) : "memory");
#else
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (src_size) x = *reinterpret_cast<const uint4*>(gmem_src);
    *reinterpret_cast<uint4*>(__cvta_shared_to_generic(smem_dst)) = x;
#endif
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    cp_async_16(smem_addr(smem_dst), gmem_src, valid ? 16u : 0u);
}

// 8 bytes global → shared (a pair of the backward's row statistics, whose rows are not
// 16-byte aligned): .ca, the variant that has sizes below 16; `valid` false zero-fills.
// Below sm_80 a plain synchronous copy.
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* gmem_src, bool valid) {
#if CUFLASH_ARCH >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(valid ? 8u : 0u) : "memory");
#else
    *reinterpret_cast<uint2*>(smem_dst) =
        valid ? *reinterpret_cast<const uint2*>(gmem_src) : make_uint2(0u, 0u);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if CUFLASH_ARCH >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if CUFLASH_ARCH >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}

// ---------------------------------------------------------------------------------
// Two f32 → one .b32 of two 16-bit values, round to nearest even; `lo` in the low half
// (the lower column of a fragment pair). cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the
// upper half, so the operands are (hi, lo).
// ---------------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
#if CUFLASH_ARCH >= 800
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    return (unsigned)__half_as_ushort(__float2half_rn(lo)) |
           ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
#endif
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
#if CUFLASH_ARCH >= 800
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    __trap();
    return 0u;
#endif
}


// ---------------------------------------------------------------------------------
// tf32 (sm_80+): float32 operands on tensor cores. A tf32 value is an fp32 register whose
// low 13 bits are zero (10 fraction bits); the mma reads only the upper 19 bits.
//
// Fragments of mma.m16n8k8 .tf32 (PTX ISA 9.7.13.4.7): one element per .b32 register,
// the k index is t or t + 4 (not 2t, 2t + 1 as for 16-bit types):
//   A 16x8:  a0 = A[g][t]   a1 = A[g + 8][t]   a2 = A[g][t + 4]   a3 = A[g + 8][t + 4]
//   B 8x8:   b0 = B[t][g]   b1 = B[t + 4][g]            (k = t, t + 4; column n = g)
//   C, D:    as m16n8k16 above (c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g + 8][2t, 2t+1])
// FragA and FragB carry them (4 and 2 .b32 registers, the same counts).
// ---------------------------------------------------------------------------------

// D = A·B + D, tf32 inputs (sm_80+), A 16x8 and B 8x8 in the tf32 layout above.
__device__ __forceinline__ void mma_m16n8k8_tf32(FragC& d, const FragA& a, const FragB& b) {
#if CUFLASH_ARCH >= 800
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d.c0), "+f"(d.c1), "+f"(d.c2), "+f"(d.c3)
                 : "r"(a.a0), "r"(a.a1), "r"(a.a2), "r"(a.a3), "r"(b.b0), "r"(b.b1));
#else
    __trap();
#endif
}

// fp32 → tf32, round to nearest, ties away from zero (cvt.rna.tf32.f32, PTX ISA 9.7.9.21):
// the .b32 result is an fp32 bit pattern with its low 13 bits cleared.
__device__ __forceinline__ unsigned to_tf32(float x) {
#if CUFLASH_ARCH >= 800
    unsigned d;
    asm volatile("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(d) : "f"(x));
    return d;
#else
    __trap();
    return 0u;
#endif
}

}  // namespace cuflash
