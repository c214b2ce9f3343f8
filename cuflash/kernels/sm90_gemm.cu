// sm90_gemm.cu — C = A·Bᵀ on Hopper's asynchronous machinery (sm_90a), the smallest kernel that
// runs it all: A (M × K) and B (N × K) f16 row-major, C (M × N) f32, one 128 × 128 tile of C per
// block, K in 64-wide steps through a two-stage ring of shared buffers.
//
//   warpgroup 2 (producer)  gives registers up; one elected thread, per K step: wait until the
//                           consumers freed the stage (empty), announce its bytes and start
//                           the two TMA boxes (full)
//   warpgroups 0, 1         take registers; per K step: wait for the boxes (full), four
//   (consumers)             wgmma m64n128k16 on rows 64w.. of A and all of B, wait for them,
//                           free the stage (empty); then write the accumulators to C
//
// TMA lays each box out in 128-byte rows swizzled as wgmma's K-major 128-byte layout reads them.
// M, N and K are multiples of 128, 128 and 64.
#include "sm90.cuh"

namespace {
constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 64, kStages = 2;
constexpr unsigned kStageBytes = (kBlockM + kBlockN) * kBlockK * 2;

struct __align__(1024) Stage {
    unsigned short a[kBlockM * kBlockK];   // 16 KB: 128 rows of 128 bytes
    unsigned short b[kBlockN * kBlockK];
};
}  // namespace

extern "C" __global__ void __launch_bounds__(384) sm90_gemm(const __grid_constant__ sm90::TensorMap map_a,
                                                            const __grid_constant__ sm90::TensorMap map_b,
                                                            float* __restrict__ c, int n, int k) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Stage* stage = reinterpret_cast<Stage*>(smem_raw);
    __shared__ __align__(8) unsigned long long full[kStages], empty[kStages];
    const int warpgroup = threadIdx.x / 128, m0 = blockIdx.y * kBlockM, n0 = blockIdx.x * kBlockN;
    const int k_steps = k / kBlockK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            sm90::mbar_init(&full[s], 1);
            sm90::mbar_init(&empty[s], 256);
        }
        sm90::mbar_init_fence();
    }
    __syncthreads();

    if (warpgroup == 2) {   // producer
        sm90::regs_dec<40>();
        if (threadIdx.x / 32 == 8 && sm90::elect_one()) {
            for (int t = 0; t < k_steps; ++t) {
                const int s = t % kStages;
                if (t >= kStages) sm90::mbar_wait(&empty[s], (t / kStages - 1) & 1);
                sm90::mbar_arrive_expect_tx(&full[s], kStageBytes);
                sm90::tma_load_2d(stage[s].a, map_a, t * kBlockK, m0, &full[s]);
                sm90::tma_load_2d(stage[s].b, map_b, t * kBlockK, n0, &full[s]);
            }
        }
        return;
    }

    sm90::regs_inc<232>();   // consumers
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int t = 0; t < k_steps; ++t) {
        const int s = t % kStages;
        sm90::mbar_wait(&full[s], (t / kStages) & 1);
        const unsigned long long da = sm90::desc_k_major_sw128(stage[s].a + warpgroup * 64 * kBlockK);
        const unsigned long long db = sm90::desc_k_major_sw128(stage[s].b);
        sm90::wgmma_fence();
        for (int kk = 0; kk < kBlockK / 16; ++kk)   // 16 columns of K = 32 bytes = 2 in the descriptor
            sm90::wgmma_m64n128k16_ss<__half>(acc, da + 2 * kk, db + 2 * kk, 1);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::mbar_arrive(&empty[s]);
    }
    // accumulator i: row 16 (warp % 4) + lane / 4 (+8 for i % 4 >= 2), column 8 (i / 4) + 2 (lane % 4) + i % 2
    const int lane = threadIdx.x % 32, row = m0 + warpgroup * 64 + (threadIdx.x / 32 % 4) * 16 + lane / 4;
    for (int i = 0; i < 64; ++i)
        c[(long)(row + 8 * (i / 2 % 2)) * n + n0 + 8 * (i / 4) + 2 * (lane % 4) + i % 2] = acc[i];
}
