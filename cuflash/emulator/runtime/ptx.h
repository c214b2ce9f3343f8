// cuflash CPU emulator: the PTX ISA's warp-wide tensor-core instructions as functions of the
// 32 lanes' operands (no fibers here; runtime.cpp gathers the lanes and calls these).
#ifndef CUFLASH_EMULATOR_PTX_H
#define CUFLASH_EMULATOR_PTX_H

#include <stdint.h>

// One lane's operands of mma.sync.aligned.m16n8k{8,16}.row.col.f32.{f16,bf16,tf32}.*.f32:
// registers as the ISA numbers them, C and D as fp32 bit patterns.
struct EmuMmaLane {
    uint32_t a[4], b[2], c[4];
    uint32_t* d;
};

// How the tensor core sums (cuflash/emulator/archs.py, TensorCoreArithmetic).
struct EmuMmaArith {
    int block_k, extra_bits, min_exponent;
};

// D = A·B + C for the warp, summed as the tensor core does; k is 8 or 16, type an EmuMmaType.
void emu_mma(int k, int type, const EmuMmaArith& arith, EmuMmaLane* const lanes[32]);

// One lane of ldmatrix.sync.aligned.m8n8.xN{.trans}.b16: the 16-byte row it addresses
// (lanes 8j..8j+7 give matrix j's rows), and where its N result registers go.
struct EmuLdmatrixLane {
    uint16_t row[8];
    uint32_t* d;
};
void emu_ldmatrix(int num, int trans, EmuLdmatrixLane* const lanes[32]);

// One lane of stmatrix.sync.aligned.m8n8.xN{.trans}.b16: its N registers, and the 16-byte row
// it addresses (lanes 8j..8j+7 give matrix j's rows).
struct EmuStmatrixLane {
    uint32_t r[4];
    uint16_t* row;
};
void emu_stmatrix(int num, int trans, EmuStmatrixLane* const lanes[32]);

// D (64 x n) = A (64 x k) · B (k x n) + C of wgmma.mma_async, every element summed as
// emu_mma sums (blocks of block_k products along k); matrices row-major, as element bit
// patterns (16-bit in the low half for .f16/.bf16, the fp32 register for .tf32; C, D fp32).
void emu_wgmma(int n, int k, int type, const EmuMmaArith& arith, const uint32_t* A, const uint32_t* B,
               const uint32_t* C, uint32_t* D);

// A wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format").
struct EmuWgmmaDesc {
    uint32_t start, lbo, sbo;   // bytes
    int base_offset;
    int swizzle;                // bytes of the swizzle pattern's row: 0 (none), 32, 64, 128
};
EmuWgmmaDesc emu_wgmma_desc(uint64_t d);
// The shared address of element (mn, k) of an MN x K operand (A: m, k; B: n, k) stored
// K-major (`k_major`) or MN-major, 2 or 4 bytes per element, as the descriptor lays it out
// (every count a power of two: shifts and masks)
static inline uint32_t emu_wgmma_address(const EmuWgmmaDesc& d, bool k_major, int elem, int mn, int k) {
    const int es = elem == 2 ? 1 : 2, ts = 4 - es;   // log2 of the element size, of the elements in 16 bytes
    uint32_t off;
    if (d.swizzle == 0) {
        // core matrices of 8 rows of 16 bytes, rows along MN (K-major) or along K (MN-major)
        off = k_major ? (mn >> 3) * d.sbo + (k >> ts) * d.lbo + (mn & 7) * 16 + ((k & ((1 << ts) - 1)) << es)
                      : (mn >> ts) * d.sbo + (k >> 3) * d.lbo + (k & 7) * 16 + ((mn & ((1 << ts) - 1)) << es);
    } else {
        // swizzle atoms of 8 rows of `swizzle` bytes (K-major: one atom row holds the
        // instruction's 32 bytes of K; LBO is not used)
        const int ws = __builtin_ctz((unsigned)d.swizzle) - es;   // log2 of the elements in an atom row
        off = k_major ? (mn >> 3) * d.sbo + (mn & 7) * d.swizzle + (k << es)
                      : (mn >> ws) * d.lbo + (k >> 3) * d.sbo + (k & 7) * d.swizzle + ((mn & ((1 << ws) - 1)) << es);
    }
    uint32_t a = d.start + off;
    if (d.swizzle) a ^= (a >> 7 & (uint32_t)(d.swizzle / 16 - 1)) << 4;   // 16-byte chunk ^= row in the atom
    return a;
}

#endif
