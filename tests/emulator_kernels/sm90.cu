// Hopper's asynchronous PTX for tests/test_emulator_sm90.py: mbarriers, bulk copies, named
// barriers, setmaxnreg, elect.sync and stmatrix. Each PLANT_* macro plants one bug.

#include "sm90.cuh"   // cuflash/kernels: mbarrier, elect, TMA helpers
using sm90::elect_one;
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;
__device__ __forceinline__ unsigned smem_addr(const void* p) { return sm90::smem(p); }

// A producer warpgroup (warpgroup 1) streams `tiles` tiles of `TILE` floats from `in` through a
// two-stage ring of shared buffers by cp.async.bulk; the consumer warpgroup (warpgroup 0) adds one
// to every element and writes it to `out`. full[s]: the tile landed; empty[s]: it was consumed.
#define TILE 256
#define STAGES 2
extern "C" __global__ void bulk_ring(const float* in, float* out, int tiles) {
    __shared__ __align__(128) float buf[STAGES][TILE];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 128);
        }
        sm90::mbar_init_fence();
    }
    __syncthreads();
    if (tid >= 128) {   // producer: one elected thread of its first warp issues the copies
        if (tid < 160 && elect_one()) {
            for (int t = 0; t < tiles; ++t) {
                const int s = t % STAGES;
                if (t >= STAGES) mbar_wait(&empty[s], ((t / STAGES) - 1) & 1);
#ifdef PLANT_SHORT_TX
                mbar_arrive_expect_tx(&full[s], TILE * 2);
#elif defined(PLANT_LONG_TX)
                mbar_arrive_expect_tx(&full[s], TILE * 8);
#else
                mbar_arrive_expect_tx(&full[s], TILE * 4);
#endif
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(smem_addr(buf[s])), "l"(in + (long)t * TILE), "r"(TILE * 4),
                                "r"(smem_addr(&full[s])) : "memory");
            }
        }
    } else {            // consumer
        for (int t = 0; t < tiles; ++t) {
            const int s = t % STAGES;
#ifdef PLANT_PARITY
            mbar_wait(&full[s], ((t / STAGES) & 1) ^ (t > 0));   // the first wait right, the next ones inverted
#elif defined(PLANT_NO_WAIT)
            if (t == 0) mbar_wait(&full[s], 0);                  // only the first tile waited for
#else
            mbar_wait(&full[s], (t / STAGES) & 1);
#endif
            for (int i = tid; i < TILE; i += 128) out[(long)t * TILE + i] = buf[s][i] + 1.0f;
#ifdef PLANT_EXTRA_ARRIVE
            if (tid == 127)   // arrives for two threads
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], 2;" :: "r"(smem_addr(&empty[s])) : "memory");
            else
#endif
            mbar_arrive(&empty[s]);
        }
    }
}

// Threads fill a shared tile, one thread stores it to global memory by cp.async.bulk.
extern "C" __global__ void bulk_store(float* out) {
    __shared__ __align__(128) float tile[TILE];
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) tile[i] = 2.0f * i;
#ifndef PLANT_NO_FENCE
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
#ifndef PLANT_NO_BARRIER
    __syncthreads();
    if (threadIdx.x == 0) {
#else   // the last thread stores, after the others wrote (as the emulator runs them) but unordered
    if (threadIdx.x == blockDim.x - 1) {
#endif
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(out), "r"(smem_addr(tile)), "r"(TILE * 4) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#ifdef PLANT_WRITE_IN_FLIGHT
        tile[5] = -1.0f;
#endif
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        tile[5] = -1.0f;   // after the wait: the store has read the tile
    }
}

// Every block fills a shared tile (block b: b + i at i), one thread adds it to out `adds`
// times by cp.reduce.async.bulk .add.f32: out gains the sum over the blocks, whatever their
// order. The thread waits for each add to complete (a wait without .read) before the next;
// PLANT_READ_ONLY waits only for it to have read the tile, so two adds to the same floats are
// in flight together, in no defined order.
extern "C" __global__ void bulk_reduce_add(float* out, int adds) {
    __shared__ __align__(128) float tile[TILE];
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) tile[i] = blockIdx.x + (float)i;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 0; k < adds; ++k) {
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                         :: "l"(out), "r"(smem_addr(tile)), "r"(TILE * 4) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#ifdef PLANT_WRITE_IN_FLIGHT
            tile[5] = -1.0f;
#endif
#ifdef PLANT_READ_ONLY
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#else
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
        }
    }
#ifdef PLANT_ADD   // the same sum by plain adds: a race between the blocks
    if (threadIdx.x == 0)
        for (int i = 0; i < TILE; ++i) out[i] += tile[i];
#endif
}

// Warps 0-3 write, bar.arrive on barrier 1; warps 4-7 bar.sync on it and read.
extern "C" __global__ void named_barrier(float* out) {
    __shared__ float x[128];
    const int tid = threadIdx.x;
    if (tid < 128) {
        x[tid] = tid * 3.0f;
        asm volatile("bar.arrive 1, 256;" ::: "memory");
    } else {
#ifdef PLANT_COUNT
        asm volatile("bar.sync 1, 224;" ::: "memory");
#else
        asm volatile("bar.sync 1, 256;" ::: "memory");
#endif
        out[tid - 128] = x[255 - tid];
    }
}

// Warpgroup 0 gives registers up, warpgroups 1 and 2 take them.
extern "C" __global__ void setmaxnreg(int* out) {
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    } else {
#ifdef PLANT_BUDGET
        asm volatile("setmaxnreg.inc.sync.aligned.u32 256;");
#else
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
#endif
    }
    out[threadIdx.x] = 1;
}

// Each warp's elected leader, and every lane's stmatrix fragments stored into shared memory.
extern "C" __global__ void elect_and_stmatrix(const unsigned* frag, unsigned* leaders, unsigned short* rows,
                                              int trans) {
    __shared__ __align__(16) unsigned short ms[2][4][8][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned short (*m)[8][8] = ms[warp];
    unsigned leader = 99;
    if (lane >= 4)   // the lanes of the mask, and only they
        asm volatile("{\n .reg .pred p;\n elect.sync %0|p, %1;\n}" : "=r"(leader) : "r"(0xfffffff0u));
    leaders[threadIdx.x] = leader;
    unsigned r[4];
    for (int j = 0; j < 4; ++j) r[j] = frag[threadIdx.x * 4 + j];
    const unsigned row = smem_addr(&m[lane >> 3][lane & 7][0]);
    if (trans)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(row), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    else
        asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(row), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    __syncwarp();
    for (int i = lane; i < 256; i += 32) rows[warp * 256 + i] = (&m[0][0][0])[i];
}

// One box through a tensor map: loaded into shared memory and copied out byte for byte, or
// (store) the bytes given stored back through the map.
extern "C" __global__ void tma_box(const __grid_constant__ sm90::TensorMap map, int c0, int c1, int c2, int rank,
                                   unsigned char* image, int bytes, int store) {
    extern __shared__ __align__(1024) unsigned char box[];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x == 0) mbar_init(&bar, 1);
    __syncthreads();
    if (!store) {
        if (threadIdx.x == 0) {
            asm volatile("prefetch.tensormap [%0];" :: "l"(&map) : "memory");
            mbar_arrive_expect_tx(&bar, bytes);
            if (rank == 2)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                             " [%0], [%1, {%2, %3}], [%4];"
                             :: "r"(smem_addr(box)), "l"(&map), "r"(c0), "r"(c1), "r"(smem_addr(&bar)) : "memory");
            else
                asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1, {%2, %3, %4}], [%5];"
                             :: "r"(smem_addr(box)), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(&bar))
                             : "memory");
        }
        mbar_wait(&bar, 0);
        for (int i = threadIdx.x; i < bytes; i += blockDim.x) image[i] = box[i];
    } else {
        for (int i = threadIdx.x; i < bytes; i += blockDim.x) box[i] = image[i];
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (threadIdx.x == 0) {
            if (rank == 2)
                asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                             :: "l"(&map), "r"(c0), "r"(c1), "r"(smem_addr(box)) : "memory");
            else
                asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];"
                             :: "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(box)) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        }
    }
}
