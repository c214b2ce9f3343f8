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

#endif
