// Reverse a chunk through dynamic shared memory while a device function keeps a value in a
// static __shared__ array: on CUDA the two share the launch's shared-memory limit.
__device__ int block_broadcast(int v) {
    __shared__ int value[2];  // both written (by threads 0 and 1), so neither is optimised out
    if (threadIdx.x < 2) value[threadIdx.x] = v;
    __syncthreads();
    return value[0];
}

extern "C" __global__ void reverse_broadcast(const float* __restrict__ x, float* __restrict__ y, int n) {
    extern __shared__ float buf[];
    const int t = threadIdx.x;
    const int m = block_broadcast(min((int)blockDim.x, n));
    if (t < m) buf[t] = x[t];
    __syncthreads();
    if (t < m) y[t] = buf[m - 1 - t];
}
