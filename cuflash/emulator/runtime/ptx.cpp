// cuflash CPU emulator: mma.sync and ldmatrix with the PTX ISA's fragment layouts
// (g = lane >> 2, t = lane % 4; in a .b32 register the lower index sits in the low 16 bits)
// and the tensor core's own arithmetic (see cuflash/emulator/archs.py).
#include "ptx.h"
#include "abi.h"

#include <stdint.h>
#include <vector>

namespace {

// An operand as m·2^q with integer significand m; e is the exponent the tensor core aligns
// by: the format's exponent field, subnormals at the format's least exponent.
enum Kind : uint8_t { ZERO, FINITE, INF, NAN_ };
struct Term {
    Kind kind;
    bool neg;
    uint64_t m;
    int q, e;
};

Term decode(uint32_t bits, int exp_bits, int frac_bits) {
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t field = (bits >> frac_bits) & ((1u << exp_bits) - 1), frac = bits & ((1u << frac_bits) - 1);
    Term t{};
    t.neg = (bits >> (exp_bits + frac_bits)) & 1;
    if (field == (1u << exp_bits) - 1) {
        t.kind = frac ? NAN_ : INF;
        return t;
    }
    t.e = (field ? (int)field : 1) - bias;
    t.m = field ? (frac | (1u << frac_bits)) : frac;
    t.q = t.e - frac_bits;
    t.kind = t.m ? FINITE : ZERO;
    return t;
}

Term decode_operand(int type, uint32_t bits) {
    switch (type) {
        case EMU_MMA_F16: return decode(bits & 0xffff, 5, 10);
        case EMU_MMA_BF16: return decode(bits & 0xffff, 8, 7);
        default: return decode(bits >> 13, 8, 10);   // tf32: the fp32 register without its low 13 bits
    }
}

// value = mag · 2^lsb with sign `neg`, truncated toward zero to fp32
uint32_t to_f32_rz(bool neg, uint64_t mag, int lsb) {
    const uint32_t sign = neg ? 0x80000000u : 0u;
    if (mag == 0) return sign;
    const int n = 64 - __builtin_clzll(mag);
    const int e = n - 1 + lsb;
    if (e > 127) return sign | 0x7f7fffffu;   // toward zero, an overflow stops at the largest finite
    if (e < -126) {                           // subnormal: a multiple of 2^-149
        const int sh = -149 - lsb;
        return sign | (uint32_t)(sh >= 64 ? 0 : sh >= 0 ? mag >> sh : mag << -sh);
    }
    const uint64_t m = n > 24 ? mag >> (n - 24) : mag << (24 - n);
    return sign | (uint32_t)(e + 127) << 23 | (uint32_t)(m & 0x7fffff);
}

// c + Σ a[i]·b[i] over one block of n products (a, b decoded; a strided by 1, b by b_stride)
uint32_t block_fma(const Term* a, const Term* b, int b_stride, int n, uint32_t c, const EmuMmaArith& arith) {
    Term terms[17];
    int nt = 0;
    bool nan = false, pos_inf = false, neg_inf = false, all_neg_zero = true;
    for (int i = 0; i < n; ++i) {
        const Term& x = a[i];
        const Term& y = b[i * b_stride];
        const bool neg = x.neg != y.neg;
        if (x.kind == FINITE && y.kind == FINITE) {
            // exact product; aligned by the sum of the exponents (its significand lies in [1, 4))
            terms[nt++] = Term{FINITE, neg, x.m * y.m, x.q + y.q, x.e + y.e};
        } else if (x.kind == NAN_ || y.kind == NAN_ || (x.kind == INF && y.kind == ZERO) ||
                   (x.kind == ZERO && y.kind == INF)) {
            nan = true;
        } else if (x.kind == INF || y.kind == INF) {
            (neg ? neg_inf : pos_inf) = true;
        } else {
            all_neg_zero &= neg;
        }
    }
    const Term z = decode(c, 8, 23);
    if (z.kind == NAN_) nan = true;
    else if (z.kind == INF) (z.neg ? neg_inf : pos_inf) = true;
    else if (z.kind == FINITE) terms[nt++] = z;
    else all_neg_zero &= z.neg;
    // IEEE-like specials: any NaN, or inf - inf, is the canonical NaN
    if (nan || (pos_inf && neg_inf)) return 0x7fffffffu;
    if (pos_inf || neg_inf) return pos_inf ? 0x7f800000u : 0xff800000u;
    if (nt == 0) return all_neg_zero ? 0x80000000u : 0u;   // only zeros: -0 when every one is -0
    // align every term to the largest exponent (floored), keep 23 + extra_bits fraction bits
    // below it, truncating (no sticky bit), and sum the integers exactly
    int emax = arith.min_exponent;
    for (int i = 0; i < nt; ++i) emax = terms[i].e > emax ? terms[i].e : emax;
    const int lsb = emax - 23 - arith.extra_bits;
    int64_t sum = 0;
    for (int i = 0; i < nt; ++i) {
        const int sh = lsb - terms[i].q;
        const uint64_t v = sh >= 64 ? 0 : sh >= 0 ? terms[i].m >> sh : terms[i].m << -sh;
        sum += terms[i].neg ? -(int64_t)v : (int64_t)v;
    }
    return to_f32_rz(sum < 0, sum < 0 ? (uint64_t)-sum : (uint64_t)sum, lsb);
}

}  // namespace

void emu_mma(int k, int type, const EmuMmaArith& arith, EmuMmaLane* const lanes[32]) {
    // gather A (16 x k), B (k x 8), C (16 x 8) from the fragments, as element bit patterns
    uint32_t A[16][16] = {}, B[16][8] = {}, C[16][8] = {};
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane % 4;
        const EmuMmaLane& L = *lanes[lane];
        if (type == EMU_MMA_TF32) {
            // m16n8k8 .tf32: a0 (g,t) a1 (g+8,t) a2 (g,t+4) a3 (g+8,t+4); b0 (k=t) b1 (k=t+4), n = g
            for (int i = 0; i < 4; ++i) A[g + 8 * (i & 1)][t + 4 * (i >> 1)] = L.a[i];
            for (int i = 0; i < 2; ++i) B[t + 4 * i][g] = L.b[i];
        } else {
            // .f16/.bf16: a_i at row g (+8 for i = 2,3,6,7), col 2t + (i & 1) (+8 for i >= 4);
            // b_i at k = 2t + (i & 1) (+8 for i >= 2), n = g; m16n8k8 is the k < 8 half
            for (int i = 0; i < k / 2; ++i)
                A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >> 2)] = (L.a[i >> 1] >> (16 * (i & 1))) & 0xffff;
            for (int i = 0; i < k / 4; ++i)
                B[2 * t + (i & 1) + 8 * (i >> 1)][g] = (L.b[i >> 1] >> (16 * (i & 1))) & 0xffff;
        }
        // c_i at row g (+8 for i >= 2), col 2t + (i & 1)
        for (int i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = L.c[i];
    }
    Term At[16][16], Bt[16][8];
    for (int i = 0; i < 16; ++i)
        for (int kk = 0; kk < k; ++kk) At[i][kk] = decode_operand(type, A[i][kk]);
    for (int kk = 0; kk < k; ++kk)
        for (int j = 0; j < 8; ++j) Bt[kk][j] = decode_operand(type, B[kk][j]);
    uint32_t D[16][8];
    for (int row = 0; row < 16; ++row)
        for (int col = 0; col < 8; ++col) {
            uint32_t acc = C[row][col];
            // blocks of block_k products in k order, each block's result the next one's c
            for (int k0 = 0; k0 < k; k0 += arith.block_k) {
                const int n = k - k0 < arith.block_k ? k - k0 : arith.block_k;
                acc = block_fma(&At[row][k0], &Bt[k0][col], 8, n, acc, arith);
            }
            D[row][col] = acc;
        }
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane % 4;
        for (int i = 0; i < 4; ++i) lanes[lane]->d[i] = D[g + 8 * (i >> 1)][2 * t + (i & 1)];
    }
}

void emu_ldmatrix(int num, int trans, EmuLdmatrixLane* const lanes[32]) {
    // matrix j's row r is the 16 bytes lane 8j + r addressed
    for (int lane = 0; lane < 32; ++lane) {
        const int r = lane >> 2, c = 2 * (lane % 4);
        for (int j = 0; j < num; ++j) {
            uint16_t lo, hi;
            if (!trans) {   // row l>>2, cols 2(l%4) and 2(l%4)+1
                lo = lanes[8 * j + r]->row[c];
                hi = lanes[8 * j + r]->row[c + 1];
            } else {        // transposed: (row 2(l%4), col l>>2) and (row 2(l%4)+1, col l>>2)
                lo = lanes[8 * j + c]->row[r];
                hi = lanes[8 * j + c + 1]->row[r];
            }
            lanes[lane]->d[j] = (uint32_t)hi << 16 | lo;
        }
    }
}

void emu_stmatrix(int num, int trans, EmuStmatrixLane* const lanes[32]) {
    // ldmatrix in reverse: register j of lane l holds row l>>2, columns 2(l%4), 2(l%4)+1 of matrix j
    for (int lane = 0; lane < 32; ++lane) {
        const int r = lane >> 2, c = 2 * (lane % 4);
        for (int j = 0; j < num; ++j) {
            const uint16_t lo = lanes[lane]->r[j] & 0xffff, hi = lanes[lane]->r[j] >> 16;
            if (!trans) {
                lanes[8 * j + r]->row[c] = lo;
                lanes[8 * j + r]->row[c + 1] = hi;
            } else {   // stored column-major: element (r, c) goes to row c's address, position r
                lanes[8 * j + c]->row[r] = lo;
                lanes[8 * j + c + 1]->row[r] = hi;
            }
        }
    }
}

// block_fma for blocks of finite operands and accumulator with at least one nonzero term (what
// almost every block is): the same alignment and sum, without the special-value bookkeeping.
// Zeros carry m = 0 and an exponent below any, so they neither count nor align.
namespace {
struct Fast {
    uint64_t m;
    int q, e;
    bool neg;
};
constexpr int kZeroExponent = -100000;

Fast fast(const Term& t) {
    return t.kind == FINITE ? Fast{t.m, t.q, t.e, t.neg} : Fast{0, 0, kZeroExponent, t.neg};
}

// the sum, or false when the block needs block_fma (a special value, or zeros only)
bool fast_block(const Fast* a, const Fast* b, int b_stride, int n, const Term& c, const EmuMmaArith& arith,
                uint32_t* out) {
    if (c.kind == INF || c.kind == NAN_) return false;
    int emax = arith.min_exponent, nonzero = c.kind == FINITE;
    if (nonzero && c.e > emax) emax = c.e;
    for (int i = 0; i < n; ++i) {
        const int e = a[i].e + b[i * b_stride].e;
        const bool live = a[i].m && b[i * b_stride].m;
        nonzero |= live;
        if (live && e > emax) emax = e;
    }
    if (!nonzero) return false;
    const int lsb = emax - 23 - arith.extra_bits;
    int64_t sum = 0;
    for (int i = 0; i < n; ++i) {
        const Fast& x = a[i];
        const Fast& y = b[i * b_stride];
        const uint64_t p = x.m * y.m;
        if (!p) continue;
        const int sh = lsb - (x.q + y.q);
        const uint64_t v = sh >= 64 ? 0 : sh >= 0 ? p >> sh : p << -sh;
        sum += x.neg != y.neg ? -(int64_t)v : (int64_t)v;
    }
    if (c.kind == FINITE) {
        const int sh = lsb - c.q;
        const uint64_t v = sh >= 64 ? 0 : sh >= 0 ? c.m >> sh : c.m << -sh;
        sum += c.neg ? -(int64_t)v : (int64_t)v;
    }
    *out = to_f32_rz(sum < 0, sum < 0 ? (uint64_t)-sum : (uint64_t)sum, lsb);
    return true;
}
}  // namespace

void emu_wgmma(int n, int k, int type, const EmuMmaArith& arith, const uint32_t* A, const uint32_t* B,
               const uint32_t* C, uint32_t* D) {
    // decoded operands (~100 KB at n = 256: on the heap, not a fiber's stack; "__emu_" in the
    // name keeps the emulator from taking a thread-local for a __shared__ variable)
    static thread_local std::vector<Term> __emu_at, __emu_bt;
    static thread_local std::vector<Fast> __emu_af, __emu_bf;
    std::vector<Term>& at = __emu_at;
    std::vector<Term>& bt = __emu_bt;
    std::vector<Fast>& af = __emu_af;
    std::vector<Fast>& bf = __emu_bf;
    at.resize(64 * 16);
    bt.resize(16 * 256);
    af.resize(64 * 16);
    bf.resize(16 * 256);
    bool special = false;   // an inf or NaN operand: every block takes block_fma
    for (int i = 0; i < 64; ++i)
        for (int kk = 0; kk < k; ++kk) {
            const Term t = decode_operand(type, A[i * k + kk]);
            at[i * 16 + kk] = t;
            af[i * 16 + kk] = fast(t);
            special |= t.kind == INF || t.kind == NAN_;
        }
    for (int kk = 0; kk < k; ++kk)
        for (int j = 0; j < n; ++j) {
            const Term t = decode_operand(type, B[kk * n + j]);
            bt[j * 16 + kk] = t;   // column-major: a column's k contiguous
            bf[j * 16 + kk] = fast(t);
            special |= t.kind == INF || t.kind == NAN_;
        }
    for (int row = 0; row < 64; ++row)
        for (int col = 0; col < n; ++col) {
            uint32_t acc = C[row * n + col];
            for (int k0 = 0; k0 < k; k0 += arith.block_k) {
                const int nb = k - k0 < arith.block_k ? k - k0 : arith.block_k;
                if (special || !fast_block(&af[row * 16 + k0], &bf[col * 16 + k0], 1, nb, decode(acc, 8, 23), arith,
                                           &acc))
                    acc = block_fma(&at[row * 16 + k0], &bt[col * 16 + k0], 1, nb, acc, arith);
            }
            D[row * n + col] = acc;
        }
}

EmuWgmmaDesc emu_wgmma_desc(uint64_t d) {
    static const int swizzle[4] = {0, 128, 64, 32};   // bits 62-63
    return EmuWgmmaDesc{(uint32_t)(d & 0x3fff) << 4, (uint32_t)(d >> 16 & 0x3fff) << 4,
                        (uint32_t)(d >> 32 & 0x3fff) << 4, (int)(d >> 49 & 7), swizzle[d >> 62]};
}

