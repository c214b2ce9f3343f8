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
// K-major (`k_major`) or MN-major, `elem` bytes per element, as the descriptor lays it out.
uint32_t emu_wgmma_address(const EmuWgmmaDesc& d, bool k_major, int elem, int mn, int k);

#endif
