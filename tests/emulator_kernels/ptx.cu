// Tensor-core PTX as a GPU kernel writes it: one asm volatile per instruction in a small
// wrapper (PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions", "ldmatrix",
// "cp.async"), and test kernels that move raw fragment registers in and out, so the test can
// check every lane and register against its own model of the ISA tables.
// Kernels that need sm_80 are compiled for sm_80 and newer only, as a GPU source must be.
// Planted bugs: -DSKIP_WAIT (no cp.async.wait_group), -DROW_SKEW=8 (ldmatrix rows 8 bytes off
// their 16-byte alignment), -DALL_ARCHS (sm_80 kernels on every arch), the divergent_* kernels.

// ---- wrappers ----
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                 const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                  const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m16n8k8_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// accumulates in place: C and D are the same registers ("+f")
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int NUM, bool TRANS>
__device__ __forceinline__ void ldmatrix(unsigned (&d)[4], unsigned smem_addr) {
    if (NUM == 1 && !TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(d[0]) : "r"(smem_addr));
    if (NUM == 2 && !TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(d[0]), "=r"(d[1]) : "r"(smem_addr));
    if (NUM == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_addr));
    if (NUM == 1 && TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(d[0]) : "r"(smem_addr));
    if (NUM == 2 && TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared::cta.b16 {%0, %1}, [%2];\n" : "=r"(d[0]), "=r"(d[1]) : "r"(smem_addr));
    if (NUM == 4 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(smem_addr));
}

template <int CP_SIZE>
__device__ __forceinline__ void cp_async_ca(unsigned dst, const void* src, unsigned src_size) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" :: "r"(dst), "l"(src), "n"(CP_SIZE), "r"(src_size)
                 : "memory");
}
__device__ __forceinline__ void cp_async_cg16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ unsigned cvt_f16x2(float hi, float lo) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ unsigned cvt_bf16x2(float hi, float lo) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ unsigned cvt_tf32(float x) {
    unsigned d;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(d) : "f"(x));
    return d;
}
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- kernels: raw fragments in and out, one problem per warp and loop ----
// a: [count][32][4] registers, b: [count][32][2], c and d: [count][32][4]
#define MMA_KERNEL(NAME, CALL)                                                                       \
    extern "C" __global__ void NAME(const unsigned* a, const unsigned* b, const float* c, float* d, int count) { \
        const int lane = threadIdx.x % 32;                                                           \
        const int warps = gridDim.x * blockDim.x / 32;                                               \
        for (int p = (blockIdx.x * blockDim.x + threadIdx.x) / 32; p < count; p += warps) {          \
            const long i = (long)p * 32 + lane;                                                      \
            const unsigned ra[4] = {a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]};             \
            const unsigned rb[2] = {b[2 * i], b[2 * i + 1]};                                         \
            float rc[4] = {c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]};                      \
            float rd[4];                                                                             \
            CALL;                                                                                    \
            for (int r = 0; r < 4; ++r) d[4 * i + r] = rd[r];                                        \
        }                                                                                            \
    }
MMA_KERNEL(mma_m16n8k8_f16_kernel, mma_m16n8k8_f16(rd, ra, rb, rc))
#if __CUDA_ARCH__ >= 800 || defined(ALL_ARCHS)
MMA_KERNEL(mma_m16n8k16_f16_kernel, mma_m16n8k16_f16(rd, ra, rb, rc))
MMA_KERNEL(mma_m16n8k16_bf16_kernel, mma_m16n8k16_bf16(rd, ra, rb, rc))
MMA_KERNEL(mma_m16n8k8_tf32_kernel, (mma_m16n8k8_tf32(rc, ra, rb), rd[0] = rc[0], rd[1] = rc[1], rd[2] = rc[2], rd[3] = rc[3]))

// One warp: `rows` (64 rows of 8 b16 = 1 KiB) into shared memory, then ldmatrix with lane l
// addressing row rowidx[l]; d: [32][NUM] registers.
#ifndef ROW_SKEW
#define ROW_SKEW 0
#endif
template <int NUM, bool TRANS>
__global__ void ldmatrix_kernel(const unsigned short* rows, const int* rowidx, unsigned* d) {
    __shared__ __align__(16) unsigned short tile[64 * 8 + 8];
    const int lane = threadIdx.x;
    for (int i = lane; i < 64 * 8; i += 32) tile[i] = rows[i];
    __syncwarp();
    unsigned r[4];
    const unsigned base = (unsigned)__cvta_generic_to_shared(tile);
    ldmatrix<NUM, TRANS>(r, base + rowidx[lane] * 16 + ROW_SKEW);
    for (int j = 0; j < NUM; ++j) d[lane * NUM + j] = r[j];
}

// Each thread copies src[thread] (CP_SIZE bytes, of which src_size[thread] are read) into
// shared memory with cp.async.ca; out gets the shared bytes after the wait and a barrier.
template <int CP_SIZE>
__global__ void cp_async_sizes(const unsigned char* src, const int* src_size, unsigned char* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = threadIdx.x;
    cp_async_ca<CP_SIZE>((unsigned)__cvta_generic_to_shared(smem + t * CP_SIZE), src + t * CP_SIZE, src_size[t]);
    cp_async_commit();
#ifndef SKIP_WAIT
    cp_async_wait<0>();
#endif
    __syncthreads();
    // a neighbour's bytes: visible through the barrier after its wait
    const int u = (t + 1) % blockDim.x;
    for (int i = 0; i < CP_SIZE; ++i) out[t * CP_SIZE + i] = smem[u * CP_SIZE + i];
}

// Groups land in commit order: three groups of one 16-byte copy each (cg); after
// wait_group 2 / 1 / 0 the thread snapshots its three destinations into seen[step][3][16].
extern "C" __global__ void cp_async_groups(const unsigned char* src, unsigned char* seen) {
    __shared__ __align__(16) unsigned char buf[3][32][16];
    const int t = threadIdx.x;
    for (int g = 0; g < 3; ++g) {
        cp_async_cg16((unsigned)__cvta_generic_to_shared(&buf[g][t][0]), src + (g * 32 + t) * 16);
        cp_async_commit();
    }
    unsigned char* s = seen + t * 3 * 3 * 16;
#define SNAPSHOT(step)                                                     \
    for (int g = 0; g < 3; ++g)                                            \
        for (int i = 0; i < 16; ++i) s[(step * 3 + g) * 16 + i] = buf[g][t][i];
    cp_async_wait<2>();
    SNAPSHOT(0)
    cp_async_wait<1>();
    SNAPSHOT(1)
    cp_async_wait_all();
    SNAPSHOT(2)
}

// element-wise conversions and ex2: out[i] = {cvt_f16x2(x, y), cvt_bf16x2(x, y), cvt_tf32(x), ex2(x)}
extern "C" __global__ void convert(const float* x, const float* y, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[4 * i] = cvt_f16x2(x[i], y[i]);
    out[4 * i + 1] = cvt_bf16x2(x[i], y[i]);
    out[4 * i + 2] = cvt_tf32(x[i]);
    const float e = ex2(x[i]);
    out[4 * i + 3] = __float_as_uint(e);
}

// Half of the warp runs one mma.sync, the other half another: .aligned forbids it.
extern "C" __global__ void divergent_mma(float* d) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c[4] = {1, 1, 1, 1};
    float r[4];
    if (threadIdx.x < 16) {
        mma_m16n8k16_f16(r, a, b, c);
    } else {
        mma_m16n8k16_bf16(r, a, b, c);
    }
    d[threadIdx.x] = r[0];
}

// The same wrapper from two call sites of divergent branches (two mma instructions on a GPU).
extern "C" __global__ void divergent_call_sites(const float* c, float* d) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c0[4] = {c[0], c[0], c[0], c[0]}, c1[4] = {c[1], c[1], c[1], c[1]};
    float r[4];
    if (threadIdx.x < 16) {
        mma_m16n8k16_f16(r, a, b, c0);
        d[threadIdx.x] = r[0];
    } else {
        mma_m16n8k16_f16(r, a, b, c1);
        d[threadIdx.x] = 2 * r[1];
    }
}
#endif  // sm_80
