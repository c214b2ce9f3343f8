// Histogram (atomicAdd on int, in shared then global), float sum, max and a CAS-built counter.
extern "C" __global__ void atomics(const int* __restrict__ x, int n, int* hist, float* fsum, int* imax,
                                   unsigned* cas_count) {
    __shared__ int local[16];
    if (threadIdx.x < 16) local[threadIdx.x] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        atomicAdd(&local[x[i] & 15], 1);
        atomicAdd(fsum, (float)x[i]);
        atomicMax(imax, x[i]);
        unsigned old = *((volatile unsigned*)cas_count), assumed;
        do { assumed = old; old = atomicCAS(cas_count, assumed, assumed + 1u); } while (old != assumed);
    }
    __syncthreads();
    if (threadIdx.x < 16) atomicAdd(&hist[threadIdx.x], local[threadIdx.x]);
}
