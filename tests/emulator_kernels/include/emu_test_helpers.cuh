#pragma once
// A header reached through an -I option.
template <typename T>
__device__ __forceinline__ T load_or_zero(const T* p, int r, int c, int rows, int cols) {
    return (r < rows && c < cols) ? p[(long)r * cols + c] : T(0);
}
