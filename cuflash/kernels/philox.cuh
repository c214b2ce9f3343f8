// philox.cuh — Philox4x32-10 (Salmon et al., SC'11; Random123's philox.h), the counter-
// based generator dropout draws its keep decisions from.
//
// The map from (seed, b, h, i, j) to a decision is cuflash.variants' (one place in
// Python, this one in C++; the tests check both against Random123's known answers and
// against each other, bit for bit):
//     key     = (seed mod 2^32, seed div 2^32)
//     counter = (j div 4, i, h, b)
//     keep    = word (j mod 4) of Philox4x32-10(counter, key) >= floor(p · 2^32)
// so the decision depends on the element alone, never on the tiling or the thread.
#pragma once

namespace cuflash {

// hi:lo = a · b (64-bit product; NVRTC and g++ both turn it into one wide multiply).
__device__ __forceinline__ unsigned int mulhilo32(unsigned int a, unsigned int b,
                                                  unsigned int& hi) {
    const unsigned long long p = (unsigned long long)a * b;
    hi = (unsigned int)(p >> 32);
    return (unsigned int)p;
}

// Philox4x32-10: the counter (c0, c1, c2, c3) is replaced by its four output words.
__device__ __forceinline__ void philox4x32_10_words(unsigned int& c0, unsigned int& c1,
                                                    unsigned int& c2, unsigned int& c3,
                                                    unsigned int k0, unsigned int k1) {
    constexpr unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
    constexpr unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // Weyl key bumps
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {  // the key schedule: bumped between rounds (wraps mod 2^32)
            k0 += W0;
            k1 += W1;
        }
        unsigned int hi0, hi1;
        const unsigned int lo0 = mulhilo32(M0, c0, hi0);
        const unsigned int lo1 = mulhilo32(M1, c2, hi1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
}

// Word `word` (0..3) of Philox4x32-10(counter (c0, c1, c2, c3), key (k0, k1)).
__device__ __forceinline__ unsigned int philox4x32_10(unsigned int c0, unsigned int c1,
                                                      unsigned int c2, unsigned int c3,
                                                      unsigned int k0, unsigned int k1,
                                                      int word) {
    philox4x32_10_words(c0, c1, c2, c3, k0, k1);
    return word == 0 ? c0 : word == 1 ? c1 : word == 2 ? c2 : c3;
}

}  // namespace cuflash
