// Block-wide sum: per-warp shuffle reduction, then one warp reduces the per-warp partials.
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[32];
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    float v = 0.0f;
    for (int i = blockIdx.x * blockDim.x + tid; i < n; i += blockDim.x * gridDim.x) v += x[i];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0) out[blockIdx.x] = v;
    }
}

// Warp primitives: inclusive scan with __shfl_up_sync, ballot/any/all, shuffles with width 8.
extern "C" __global__ void warp_ops(const int* __restrict__ x, int* __restrict__ scan, unsigned* __restrict__ votes,
                                    int* __restrict__ seg) {
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31;
    int v = x[tid];
    for (int off = 1; off < 32; off <<= 1) {
        int u = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += u;
    }
    scan[tid] = v;
    unsigned b = __ballot_sync(0xffffffffu, x[tid] > 0);
    int any = __any_sync(0xffffffffu, x[tid] > 2);
    int all = __all_sync(0xffffffffu, x[tid] >= 0);
    if (lane == 0) {
        const int w = tid / 32;
        votes[3 * w] = b;
        votes[3 * w + 1] = (unsigned)any;
        votes[3 * w + 2] = (unsigned)all;
    }
    // segment of 8 lanes: every lane reads the value of lane 2 of its segment, and its xor-1 partner
    int s = __shfl_sync(0xffffffffu, x[tid], 2, 8) * 100 + __shfl_xor_sync(0xffffffffu, x[tid], 1, 8);
    // partial mask: only the lower half-warp takes part
    if (lane < 16) s += 10000 * __shfl_down_sync(0x0000ffffu, x[tid], 1, 16);
    seg[tid] = s;
}
