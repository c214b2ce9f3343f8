// cuflash CPU emulator: the interface between the shim (compiled into every kernel), the
// runtime (runtime.cpp) and Python (cuflash/emulator/_abi.py mirrors the Python-visible part;
// tests/test_emulator.py checks the mirror against this file).
#ifndef CUFLASH_EMULATOR_ABI_H
#define CUFLASH_EMULATOR_ABI_H

#include <stdint.h>

// ---- seen by Python ----

// EmuError::code: what ended a launch.
enum EmuErrorKind {
    EMU_ERROR_NONE = 0,
    EMU_ERROR_GENERIC = 1,
    EMU_ERROR_RACE = 2,
    EMU_ERROR_BOUNDS = 3,
    EMU_ERROR_DEADLOCK = 4,
    EMU_ERROR_TRAP = 5,   // __trap() or a failed device assert
    EMU_ERROR_FAULT = 6,  // segmentation fault or fiber stack overflow
    EMU_ERROR_HAZARD = 7, // an operand of an asynchronous operation touched before it completed
};

// EmuError::space: the memory an offending access touched.
enum EmuSpace {
    EMU_SPACE_NONE = 0,
    EMU_SPACE_SHARED_STATIC = 1,   // a __shared__ variable (offset: into the TLS block)
    EMU_SPACE_SHARED_DYNAMIC = 2,  // extern __shared__ (offset: into the dynamic buffer)
    EMU_SPACE_GLOBAL = 3,          // an array argument (offset: into argument arg_index)
};

// The order in which the runnable threads of a block are resumed.
enum EmuSchedule {
    EMU_SCHEDULE_ROUND_ROBIN = 0,
    EMU_SCHEDULE_REVERSED = 1,
    EMU_SCHEDULE_RANDOM = 2,  // a fresh permutation at every pass, seeded per launch and block
};

// How a kernel parameter is passed, recorded per parameter by the generated launcher.
enum EmuParamKind {
    EMU_PARAM_POINTER = 1,
    EMU_PARAM_FLOAT = 2,
    EMU_PARAM_SIGNED = 3,
    EMU_PARAM_UNSIGNED = 4,
    EMU_PARAM_RECORD = 5,  // a struct or class passed by value
};

// What went wrong in a launch; the thread ids are (x, y, z), -1 where not known.
struct EmuError {
    int32_t code;           // EmuErrorKind
    int32_t space;          // EmuSpace
    int32_t block[3];
    int32_t thread[3];
    int32_t other_block[3];  // the earlier conflicting access of a race
    int32_t other_thread[3];
    int32_t is_write;
    int32_t other_is_write;
    int32_t size;
    int32_t arg_index;
    uint64_t addr;
    int64_t offset;     // into the space: see EmuSpace
    uint64_t pc;        // module-relative return address of the access hook (for addr2line)
    uint64_t other_pc;
    char msg[8192];
};

// ---- between the shim and the runtime only ----

// __emu_syncthreads_op: what the barrier also computes over the block's predicates.
enum EmuBarrierOp { EMU_BARRIER_PLAIN = 0, EMU_BARRIER_COUNT = 1, EMU_BARRIER_AND = 2, EMU_BARRIER_OR = 3 };

// __emu_warp_op: the warp-synchronous operation a lane waits in.
enum EmuWarpOp {
    EMU_WARP_SHFL_IDX = 0,
    EMU_WARP_SHFL_UP = 1,
    EMU_WARP_SHFL_DOWN = 2,
    EMU_WARP_SHFL_XOR = 3,
    EMU_WARP_BALLOT = 4,
    EMU_WARP_ANY = 5,
    EMU_WARP_ALL = 6,
    EMU_WARP_SYNC = 7,
    EMU_WARP_ALLGATHER = 8,
    EMU_WARP_MMA = 9,        // mma.sync.aligned: all 32 lanes at one instruction
    EMU_WARP_LDMATRIX = 10,  // ldmatrix.sync.aligned: likewise
    EMU_WG_MMA = 11,         // wgmma.mma_async.sync.aligned: all 128 threads of a warpgroup
    EMU_WARP_STMATRIX = 12,  // stmatrix.sync.aligned: all 32 lanes at one instruction
    EMU_WG_SETMAXNREG = 13,  // setmaxnreg.sync.aligned: the warpgroup
};

// __emu_ptx_mma: the type of the A and B operands.
enum EmuMmaType { EMU_MMA_F16 = 0, EMU_MMA_BF16 = 1, EMU_MMA_TF32 = 2 };

#endif
