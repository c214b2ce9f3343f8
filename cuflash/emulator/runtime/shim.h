// cuflash CPU emulator: force-included shim that makes CUDA C compile as host C++.
// Included with `g++ -include shim.h` before the kernel source; see docs/emulator.md.
#ifndef CUFLASH_EMULATOR_SHIM_H
#define CUFLASH_EMULATOR_SHIM_H

#define CUFLASH_EMULATOR 1
#define __CUFLASH_EMULATOR__ 1

// ---- host headers first, so that the macros below cannot break them ----
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <limits.h>
#include <float.h>
#include <assert.h>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <climits>
#include <cfloat>
#include <cassert>
#include <limits>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <new>
#include <initializer_list>

#include <vector_types.h>
#include <vector_functions.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "abi.h"

// ---- CUDA keywords -> C++ ----
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __managed__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __restrict__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __shared__ thread_local
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __grid_constant__

// Cooperative groups are not emulated.
#define _COOPERATIVE_GROUPS_H_
namespace cooperative_groups { struct __cuflash_emulator_error__cooperative_groups_are_not_supported_by_the_emulator; }

#define __EMU_NOSAN __attribute__((no_sanitize("thread"), no_sanitize("address"), noinline))

extern "C" {
// thread identity (per OS thread; the scheduler updates them on every switch)
extern thread_local uint3 __emu_threadIdx;
extern thread_local uint3 __emu_blockIdx;
extern thread_local dim3 __emu_blockDim;
extern thread_local dim3 __emu_gridDim;

void __emu_syncthreads(const char* file, int line);
int __emu_syncthreads_op(int op, int pred, const char* file, int line);
unsigned long long __emu_warp_op(int op, unsigned mask, unsigned long long val, int arg, int width,
                                 const char* file, int line);
void __emu_warp_allgather(unsigned mask, const void* src, void* dst, unsigned long bytes,
                          const char* file, int line);
unsigned __emu_activemask(void);
void __emu_atomic_check(const void* p, unsigned long size, const char* file, int line);
void __emu_trap(const char* what, const char* file, int line);
unsigned long long __emu_clock(void);
}

#define threadIdx __emu_threadIdx
#define blockIdx __emu_blockIdx
#define blockDim __emu_blockDim
#define gridDim __emu_gridDim
#ifndef warpSize
#define warpSize 32
#endif

// ---- barriers, warp primitives ----
#define __syncthreads() __emu_syncthreads(__FILE__, __LINE__)
#define __syncthreads_count(p) __emu_syncthreads_op(EMU_BARRIER_COUNT, (p) ? 1 : 0, __FILE__, __LINE__)
#define __syncthreads_and(p) __emu_syncthreads_op(EMU_BARRIER_AND, (p) ? 1 : 0, __FILE__, __LINE__)
#define __syncthreads_or(p) __emu_syncthreads_op(EMU_BARRIER_OR, (p) ? 1 : 0, __FILE__, __LINE__)

template <class T>
static inline T __emu_shfl(const char* file, int line, int op, unsigned mask, T var, int arg,
                           int width = 32) {
    static_assert(sizeof(T) <= 8, "emulated shuffles move at most 8 bytes");
    unsigned long long u = 0;
    memcpy(&u, &var, sizeof(T));
    u = __emu_warp_op(op, mask, u, arg, width, file, line);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
}
#define __shfl_sync(...) __emu_shfl(__FILE__, __LINE__, EMU_WARP_SHFL_IDX, __VA_ARGS__)
#define __shfl_up_sync(...) __emu_shfl(__FILE__, __LINE__, EMU_WARP_SHFL_UP, __VA_ARGS__)
#define __shfl_down_sync(...) __emu_shfl(__FILE__, __LINE__, EMU_WARP_SHFL_DOWN, __VA_ARGS__)
#define __shfl_xor_sync(...) __emu_shfl(__FILE__, __LINE__, EMU_WARP_SHFL_XOR, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
    ((unsigned)__emu_warp_op(EMU_WARP_BALLOT, (mask), (pred) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, pred) \
    ((int)__emu_warp_op(EMU_WARP_ANY, (mask), (pred) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, pred) \
    ((int)__emu_warp_op(EMU_WARP_ALL, (mask), (pred) ? 1 : 0, 0, 32, __FILE__, __LINE__))
static inline void __emu_syncwarp(const char* f, int l, unsigned mask = 0xffffffffu) {
    __emu_warp_op(EMU_WARP_SYNC, mask, 0, 0, 32, f, l);
}
#define __syncwarp(...) __emu_syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __activemask() __emu_activemask()
// Emulator-only extension: every lane in `mask` contributes `bytes` bytes from `src`;
// each receives all 32 contributions in `dst[lane * bytes]` (lanes not in mask untouched).
// Handy for emulator implementations of warp-wide PTX (mma.sync, ldmatrix).
#define __cuflash_emu_warp_allgather(mask, src, dst, bytes) \
    __emu_warp_allgather((mask), (src), (dst), (bytes), __FILE__, __LINE__)

// ---- inline PTX ----
// cuflash/emulator/_ptx.py replaces each asm statement by calls to these (PTX ISA semantics;
// warp-wide ones meet like shuffles). Shared-memory addresses are offsets of the module's
// thread-local block, which holds every __shared__ variable and the dynamic buffer.
extern "C" {
void __emu_ptx_mma(int k, int type, const uint32_t* a, const uint32_t* b, const uint32_t* c, uint32_t* d,
                   int block_k, int extra_bits, int min_exponent, const char* file, int line);
void __emu_ptx_ldmatrix(int num, int trans, int generic, uint64_t addr, uint32_t* d, const char* file, int line);
void __emu_ptx_cp_async(uint64_t dst, uint64_t src, int cp_size, int src_size, int cg, const char* file, int line);
void __emu_ptx_cp_async_commit(void);
void __emu_ptx_cp_async_wait(int n, const char* file, int line);
void __emu_ptx_wgmma(int n, int k, int type, uint64_t desc_a, const uint32_t* a, const void* const* a_lv,
                     uint64_t desc_b, int scale_d, int scale_a, int scale_b, int trans_a, int trans_b, uint32_t* const* d,
                     int block_k, int extra_bits, int min_exponent, const char* file, int line);
void __emu_ptx_wgmma_commit(const char* file, int line);
void __emu_ptx_wgmma_wait(int n, const char* file, int line);
void __emu_ptx_fence_proxy_async(void);
void __emu_ptx_mbar_init(uint64_t addr, int generic, int count, const char* file, int line);
void __emu_ptx_mbar_inval(uint64_t addr, int generic, const char* file, int line);
uint64_t __emu_ptx_mbar_arrive(uint64_t addr, int generic, int count, int64_t tx, const char* file, int line);
void __emu_ptx_mbar_tx(uint64_t addr, int generic, int64_t tx, int complete, const char* file, int line);
int __emu_ptx_mbar_wait(uint64_t addr, int generic, uint64_t phase, int parity, int blocking, const char* file,
                        int line);
void __emu_ptx_cp_async_mbar_arrive(uint64_t addr, int generic, int noinc, const char* file, int line);
void __emu_ptx_bulk_load(uint64_t dst, uint64_t src, uint32_t size, uint64_t mbar, const char* file, int line);
void __emu_ptx_bulk_store(uint64_t dst, uint64_t src, uint32_t size, const char* file, int line);
void __emu_ptx_bulk_reduce_add_f32(uint64_t dst, uint64_t src, uint32_t size, const char* file, int line);
void __emu_ptx_bulk_commit(void);
void __emu_ptx_tensor_load(int dim, uint64_t dst, uint64_t map, const int32_t* coords, uint64_t mbar, const char* file,
                           int line);
void __emu_ptx_tensor_store(int dim, uint64_t map, const int32_t* coords, uint64_t src, const char* file, int line);
void __emu_ptx_bulk_wait(int n, int read, const char* file, int line);
void __emu_ptx_bar(int id, int count, int arrive, const char* file, int line);
void __emu_ptx_setmaxnreg(int count, int inc, const char* file, int line);
unsigned __emu_ptx_elect(unsigned mask, const char* file, int line);
void __emu_ptx_stmatrix(int num, int trans, int generic, uint64_t addr, const uint32_t* r, const char* file, int line);
size_t __emu_cvta_generic_to_shared(const void* p, const char* file, int line);
void* __emu_cvta_shared_to_generic(size_t a);
}
#define __cvta_generic_to_shared(p) __emu_cvta_generic_to_shared((p), __FILE__, __LINE__)
#define __cvta_shared_to_generic(a) __emu_cvta_shared_to_generic(a)

// an asm operand's value in its register type: numbers convert, other types keep their bits
template <class T, class S> static inline T __emu_ptx_in(const S& v) {
    if constexpr (std::is_arithmetic<S>::value || std::is_enum<S>::value) {
        return (T)v;
    } else {
        static_assert(sizeof(S) == sizeof(T), "asm operand size differs from its constraint's register");
        T t; memcpy(&t, &v, sizeof(T)); return t;
    }
}
template <class D, class T> static inline void __emu_ptx_out(D& dst, T v) {
    if constexpr (std::is_arithmetic<D>::value) {
        dst = (D)v;
    } else {
        static_assert(sizeof(D) == sizeof(T), "asm operand size differs from its constraint's register");
        memcpy(&dst, &v, sizeof(T));
    }
}
// the calling thread's lane
static inline unsigned __emu_ptx_lane() {
    return (__emu_threadIdx.x + __emu_blockDim.x * (__emu_threadIdx.y + __emu_blockDim.y * __emu_threadIdx.z)) & 31;
}
// wgmma's A registers: a variable goes by address (the runtime reads it and, in checked mode,
// guards it until the wgmma retires), any other value by its bits
template <class T> static inline const void* __emu_ptx_lvalue(T&& x) {
    return std::is_lvalue_reference<T>::value ? (const void*)&x : nullptr;
}
template <class T> static inline uint32_t __emu_ptx_rvalue_bits(T&& x) {
    if constexpr (std::is_lvalue_reference<T>::value) return 0u;
    else return __emu_ptx_in<uint32_t>(x);
}
static inline uint32_t __emu_ptx_bits(uint32_t v) { return v; }
static inline uint32_t __emu_ptx_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline void __emu_ptx_set(uint32_t& r, uint32_t bits) { r = bits; }
static inline void __emu_ptx_set(float& r, uint32_t bits) { memcpy(&r, &bits, 4); }
static inline void __emu_ptx_set(uint64_t& r, uint64_t bits) { r = bits; }

// cvt.rn.{f16x2,bf16x2}.f32 d, a, b: a to the upper half, b to the lower; NaN is canonical
static inline uint32_t __emu_ptx_cvt_rn_f16x2_f32(uint32_t a, uint32_t b) {
    float fa, fb; memcpy(&fa, &a, 4); memcpy(&fb, &b, 4);
    __half ha = __float2half_rn(fa), hb = __float2half_rn(fb);
    uint16_t ua = fa != fa ? 0x7fff : __half_raw(ha).x, ub = fb != fb ? 0x7fff : __half_raw(hb).x;
    return (uint32_t)ua << 16 | ub;
}
static inline uint32_t __emu_ptx_cvt_rn_bf16x2_f32(uint32_t a, uint32_t b) {
    float fa, fb; memcpy(&fa, &a, 4); memcpy(&fb, &b, 4);
    __nv_bfloat16 ha = __float2bfloat16_rn(fa), hb = __float2bfloat16_rn(fb);
    uint16_t ua = fa != fa ? 0x7fff : __nv_bfloat16_raw(ha).x, ub = fb != fb ? 0x7fff : __nv_bfloat16_raw(hb).x;
    return (uint32_t)ua << 16 | ub;
}
// cvt.rna.tf32.f32: to 10 fraction bits, ties away from zero (the magnitude rounds, the sign
// stays; a carry into the exponent is the next binade, or infinity); low 13 bits cleared
static inline uint32_t __emu_ptx_cvt_rna_tf32_f32(uint32_t a) {
    if ((a & 0x7f800000u) == 0x7f800000u) return (a & 0x7fffffu) ? 0x7fffffffu : a;
    return (a + 0x1000u) & 0xffffe000u;
}
// ex2.approx.f32: 2^a (the hardware is within 2 ulp; this is the correctly rounded value);
// .ftz flushes subnormal inputs and results to a zero of the same sign
static inline uint32_t __emu_ptx_ex2_approx_f32(uint32_t a, int ftz) {
    if (ftz && (a & 0x7f800000u) == 0) a &= 0x80000000u;
    float x; memcpy(&x, &a, 4);
    float r = exp2f(x);
    uint32_t u; memcpy(&u, &r, 4);
    if (ftz && (u & 0x7f800000u) == 0) u &= 0x80000000u;
    return u;
}

// ---- fences, clocks, misc ----
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_system() __atomic_thread_fence(__ATOMIC_SEQ_CST)
static inline long long clock64() { return (long long)__emu_clock(); }
static inline long long __emu_clock32() { return (long long)__emu_clock(); }
#define clock() ((int)__emu_clock32())
static inline unsigned long long __globaltimer() { return __emu_clock(); }
#define __trap() __emu_trap("__trap()", __FILE__, __LINE__)
#define __brkpt() __emu_trap("__brkpt()", __FILE__, __LINE__)
static inline void __nanosleep(unsigned) {}
#define __prof_trigger(x) ((void)0)
#define __assume(x) ((void)0)
#define __builtin_assume(x) ((void)0)

// ---- load/store cache hints ----
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline T __ldcv(const T* p) { return *p; }
template <class T> static inline void __stwb(T* p, T v) { *p = v; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// ---- float intrinsics (glibc declares __expf & co. but does not export them) ----
#define __expf expf
#define __logf logf
#define __log2f log2f
#define __log10f log10f
#define __exp10f exp10f
#define __powf powf
#define __sinf sinf
#define __cosf cosf
#define __tanf tanf
#define __sincosf sincosf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __frcp_rz(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frsqrt_rn(float a) { return 1.0f / sqrtf(a); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fadd_rz(float a, float b) { return a + b; }
static inline float __fmul_rz(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fmaf_rz(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline double __drcp_rn(double a) { return 1.0 / a; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline float __saturatef(float a) { return a > 0.0f ? (a < 1.0f ? a : 1.0f) : 0.0f; }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline double rsqrt(double a) { return 1.0 / sqrt(a); }
static inline float rcbrtf(float a) { return 1.0f / cbrtf(a); }
static inline float exp10f_(float a) { return exp10f(a); }
static inline void sincospif(float a, float* s, float* c) { *s = sinf((float)M_PI * a); *c = cosf((float)M_PI * a); }
static inline float sinpif(float a) { return sinf((float)M_PI * a); }
static inline float cospif(float a) { return cosf((float)M_PI * a); }
static inline float normcdff(float a) { return 0.5f * erfcf(-a * (float)M_SQRT1_2); }

static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
static inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
static inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
static inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
static inline int __double2hiint(double x) { return (int)(__double_as_longlong(x) >> 32); }
static inline int __double2loint(double x) { return (int)(unsigned)__double_as_longlong(x); }
static inline double __hiloint2double(int hi, int lo) {
    return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}

static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }
static inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
static inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
static inline unsigned __float2uint_rd(float x) { return (unsigned)floorf(x); }
static inline unsigned __float2uint_ru(float x) { return (unsigned)ceilf(x); }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline long long __float2ll_rz(float x) { return (long long)x; }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline float __ull2float_rn(unsigned long long x) { return (float)x; }
static inline double __int2double_rn(int x) { return (double)x; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }
static inline int __double2int_rz(double x) { return (int)x; }

static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
static inline unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
static inline int __mul24(int a, int b) { return ((a << 8) >> 8) * ((b << 8) >> 8); }
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo; return (unsigned)((v << (s & 31)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo; return (unsigned)(v >> (s & 31));
}

// min/max overloads as CUDA's math headers provide them (global namespace)
#define __EMU_MINMAX(T1, T2, R)                                                 \
    static inline R min(T1 a, T2 b) { return (R)a < (R)b ? (R)a : (R)b; }      \
    static inline R max(T1 a, T2 b) { return (R)a > (R)b ? (R)a : (R)b; }
__EMU_MINMAX(int, int, int)
__EMU_MINMAX(unsigned, unsigned, unsigned)
__EMU_MINMAX(int, unsigned, unsigned)
__EMU_MINMAX(unsigned, int, unsigned)
__EMU_MINMAX(long, long, long)
__EMU_MINMAX(unsigned long, unsigned long, unsigned long)
__EMU_MINMAX(long long, long long, long long)
__EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
__EMU_MINMAX(long long, unsigned long long, unsigned long long)
__EMU_MINMAX(unsigned long long, long long, unsigned long long)
#undef __EMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin(a, b); }
static inline double max(float a, double b) { return fmax(a, b); }
static inline double min(double a, float b) { return fmin(a, b); }
static inline double max(double a, float b) { return fmax(a, b); }

// ---- half / bfloat16 functions missing from the host side of cuda_fp16.h/cuda_bf16.h ----
#define __EMU_H1(NAME, EXPR)                                                                   \
    static inline __half NAME(const __half a) { float x = __half2float(a); return __float2half(EXPR); } \
    static inline __nv_bfloat16 NAME(const __nv_bfloat16 a) {                                     \
        float x = __bfloat162float(a); return __float2bfloat16(EXPR); }
__EMU_H1(hexp, expf(x))
__EMU_H1(hexp2, exp2f(x))
__EMU_H1(hexp10, exp10f(x))
__EMU_H1(hlog, logf(x))
__EMU_H1(hlog2, log2f(x))
__EMU_H1(hlog10, log10f(x))
__EMU_H1(hsqrt, sqrtf(x))
__EMU_H1(hrsqrt, 1.0f / sqrtf(x))
__EMU_H1(hrcp, 1.0f / x)
__EMU_H1(hsin, sinf(x))
__EMU_H1(hcos, cosf(x))
__EMU_H1(htanh, tanhf(x))
__EMU_H1(hceil, ceilf(x))
__EMU_H1(hfloor, floorf(x))
__EMU_H1(htrunc, truncf(x))
__EMU_H1(hrint, rintf(x))
#undef __EMU_H1
#define __EMU_H2(NAME, ONE)                                                                         \
    static inline __half2 NAME(const __half2 a) { return __halves2half2(ONE(__low2half(a)), ONE(__high2half(a))); } \
    static inline __nv_bfloat162 NAME(const __nv_bfloat162 a) {                                       \
        return __halves2bfloat162(ONE(__low2bfloat16(a)), ONE(__high2bfloat16(a))); }
__EMU_H2(h2exp, hexp)
__EMU_H2(h2exp2, hexp2)
__EMU_H2(h2exp10, hexp10)
__EMU_H2(h2log, hlog)
__EMU_H2(h2log2, hlog2)
__EMU_H2(h2log10, hlog10)
__EMU_H2(h2sqrt, hsqrt)
__EMU_H2(h2rsqrt, hrsqrt)
__EMU_H2(h2rcp, hrcp)
__EMU_H2(h2sin, hsin)
__EMU_H2(h2cos, hcos)
__EMU_H2(h2ceil, hceil)
__EMU_H2(h2floor, hfloor)
__EMU_H2(h2trunc, htrunc)
__EMU_H2(h2rint, hrint)
#undef __EMU_H2
static inline __half __hfma(const __half a, const __half b, const __half c) {
    return __double2half((double)__half2float(a) * (double)__half2float(b) + (double)__half2float(c));
}
static inline __nv_bfloat16 __hfma(const __nv_bfloat16 a, const __nv_bfloat16 b, const __nv_bfloat16 c) {
    return __double2bfloat16((double)__bfloat162float(a) * (double)__bfloat162float(b) + (double)__bfloat162float(c));
}
static inline __half __hfma_sat(const __half a, const __half b, const __half c) {
    float r = __half2float(__hfma(a, b, c)); return __float2half(__saturatef(r));
}
static inline __half __hfma_relu(const __half a, const __half b, const __half c) {
    float r = __half2float(__hfma(a, b, c)); return __float2half(r > 0.0f ? r : (r != r ? r : 0.0f));
}
static inline __nv_bfloat16 __hfma_relu(const __nv_bfloat16 a, const __nv_bfloat16 b, const __nv_bfloat16 c) {
    float r = __bfloat162float(__hfma(a, b, c)); return __float2bfloat16(r > 0.0f ? r : (r != r ? r : 0.0f));
}
static inline __half2 __hfma2(const __half2 a, const __half2 b, const __half2 c) {
    return __halves2half2(__hfma(__low2half(a), __low2half(b), __low2half(c)),
                          __hfma(__high2half(a), __high2half(b), __high2half(c)));
}
static inline __nv_bfloat162 __hfma2(const __nv_bfloat162 a, const __nv_bfloat162 b, const __nv_bfloat162 c) {
    return __halves2bfloat162(__hfma(__low2bfloat16(a), __low2bfloat16(b), __low2bfloat16(c)),
                              __hfma(__high2bfloat16(a), __high2bfloat16(b), __high2bfloat16(c)));
}

// ---- atomics (cooperative fibers; real atomics because blocks may run on worker threads) ----
#define __EMU_ACHK(p) __emu_atomic_check((const void*)(p), sizeof(*(p)), __FILE__, __LINE__)
template <class T, class F>
__EMU_NOSAN static T __emu_atomic_rmw(T* p, F f) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "atomic size");
    typedef typename std::conditional<sizeof(T) == 2, unsigned short,
            typename std::conditional<sizeof(T) == 4, unsigned, unsigned long long>::type>::type U;
    U* up = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(up, __ATOMIC_RELAXED);
    for (;;) {
        T o; memcpy(&o, &old, sizeof(T));
        T n = f(o);
        U nu; memcpy(&nu, &n, sizeof(T));
        if (__atomic_compare_exchange_n(up, &old, nu, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return o;
    }
}
#define __EMU_ATOMIC_FN(NAME, T, EXPR) \
    static inline T __emu_##NAME(const char* file, int line, T* p, T v) { \
        __emu_atomic_check(p, sizeof(T), file, line); \
        return __emu_atomic_rmw(p, [v](T o) -> T { return (T)(EXPR); }); }
#define __EMU_ATOMIC_ALL_INT(NAME, EXPR) \
    __EMU_ATOMIC_FN(NAME, int, EXPR) __EMU_ATOMIC_FN(NAME, unsigned, EXPR) \
    __EMU_ATOMIC_FN(NAME, unsigned long long, EXPR) __EMU_ATOMIC_FN(NAME, long long, EXPR)
__EMU_ATOMIC_ALL_INT(atomicAdd, o + v)
__EMU_ATOMIC_FN(atomicAdd, float, o + v)
__EMU_ATOMIC_FN(atomicAdd, double, o + v)
__EMU_ATOMIC_FN(atomicAdd, __half, __float2half(__half2float(o) + __half2float(v)))
__EMU_ATOMIC_FN(atomicAdd, __nv_bfloat16, __float2bfloat16(__bfloat162float(o) + __bfloat162float(v)))
__EMU_ATOMIC_FN(atomicAdd, __half2, __hadd2(o, v))
__EMU_ATOMIC_FN(atomicAdd, __nv_bfloat162, __hadd2(o, v))
__EMU_ATOMIC_FN(atomicAdd, float2, make_float2(o.x + v.x, o.y + v.y))  // sm_90+
__EMU_ATOMIC_FN(atomicSub, int, o - v)
__EMU_ATOMIC_FN(atomicSub, unsigned, o - v)
__EMU_ATOMIC_ALL_INT(atomicMax, o > v ? o : v)
__EMU_ATOMIC_ALL_INT(atomicMin, o < v ? o : v)
__EMU_ATOMIC_FN(atomicMax, float, fmaxf(o, v))
__EMU_ATOMIC_FN(atomicMin, float, fminf(o, v))
__EMU_ATOMIC_FN(atomicMax, double, fmax(o, v))
__EMU_ATOMIC_FN(atomicMin, double, fmin(o, v))
__EMU_ATOMIC_ALL_INT(atomicAnd, o & v)
__EMU_ATOMIC_ALL_INT(atomicOr, o | v)
__EMU_ATOMIC_ALL_INT(atomicXor, o ^ v)
__EMU_ATOMIC_ALL_INT(atomicExch, v)
__EMU_ATOMIC_FN(atomicExch, float, v)
__EMU_ATOMIC_FN(atomicInc, unsigned, (o >= v) ? 0u : o + 1u)
__EMU_ATOMIC_FN(atomicDec, unsigned, (o == 0u || o > v) ? v : o - 1u)
#undef __EMU_ATOMIC_FN
#undef __EMU_ATOMIC_ALL_INT
template <class T>
__EMU_NOSAN static T __emu_atomicCAS_impl(T* p, T cmp, T v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
#define __EMU_CAS(T) static inline T __emu_atomicCAS(const char* file, int line, T* p, T cmp, T v) { \
    __emu_atomic_check(p, sizeof(T), file, line); return __emu_atomicCAS_impl(p, cmp, v); }
__EMU_CAS(int)
__EMU_CAS(unsigned)
__EMU_CAS(unsigned long long)
__EMU_CAS(unsigned short)
#undef __EMU_CAS
#define atomicAdd(...) __emu_atomicAdd(__FILE__, __LINE__, __VA_ARGS__)
#define atomicSub(...) __emu_atomicSub(__FILE__, __LINE__, __VA_ARGS__)
#define atomicMax(...) __emu_atomicMax(__FILE__, __LINE__, __VA_ARGS__)
#define atomicMin(...) __emu_atomicMin(__FILE__, __LINE__, __VA_ARGS__)
#define atomicAnd(...) __emu_atomicAnd(__FILE__, __LINE__, __VA_ARGS__)
#define atomicOr(...) __emu_atomicOr(__FILE__, __LINE__, __VA_ARGS__)
#define atomicXor(...) __emu_atomicXor(__FILE__, __LINE__, __VA_ARGS__)
#define atomicExch(...) __emu_atomicExch(__FILE__, __LINE__, __VA_ARGS__)
#define atomicInc(...) __emu_atomicInc(__FILE__, __LINE__, __VA_ARGS__)
#define atomicDec(...) __emu_atomicDec(__FILE__, __LINE__, __VA_ARGS__)
#define atomicCAS(...) __emu_atomicCAS(__FILE__, __LINE__, __VA_ARGS__)
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicMax_block atomicMax
#define atomicMin_block atomicMin
#define atomicExch_block atomicExch
#define atomicCAS_block atomicCAS

#endif  // CUFLASH_EMULATOR_SHIM_H
