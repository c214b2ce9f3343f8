// cuflash CPU emulator runtime: what runtime.cpp (fibers, scheduler, barriers, warp primitives,
// checked-mode hooks, mma.sync) and sm90.cpp (Hopper's asynchronous instructions) share.
// Internal to the runtime; the kernel sees only shim.h and abi.h.
#ifndef CUFLASH_EMULATOR_RUNTIME_H
#define CUFLASH_EMULATOR_RUNTIME_H

#include <stdint.h>
#include <stddef.h>
#include <setjmp.h>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "abi.h"
#include "ptx.h"
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

struct uint3_ { unsigned x, y, z; };
struct dim3_ { unsigned x, y, z; };

#ifndef EMU_DYN_SMEM_MAX
#define EMU_DYN_SMEM_MAX (232448)  // 227 KiB, the largest opt-in shared memory of any GPU
#endif
extern "C" thread_local unsigned char __emu_dyn_smem[EMU_DYN_SMEM_MAX];

// Fiber::state
enum { F_RUNNABLE = 0, F_WAIT_BAR = 1, F_WAIT_WARP = 2, F_EXITED = 3, F_ABORTED = 4, F_WAIT_WG = 5,
       F_WAIT_MBAR = 6, F_WAIT_NAMED = 7 };

// An asynchronous operation that reads shared memory (a wgmma.mma_async of a warpgroup, a bulk
// store): in flight until each of its threads retired it.
struct AsyncOp {
    int waiting;        // threads that have not retired it
    const char* what;
    const char* file;
    int line;
};
// A register a wgmma in flight owns: an accumulator (its result lands at the retiring wait)
// or, in checked mode, a variable that held an A operand (nobody may touch it until then).
struct WgReg {
    uint32_t* addr;
    uint32_t value;
    int group;          // wgmma commit-group number, -1 until wgmma.commit_group
    AsyncOp* op;
    bool accumulator;
};

// An mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"),
// kept beside shared memory, keyed by its shared address.
struct BulkCopy;
struct MBarrier {
    bool valid;
    uint64_t phase;           // phases completed
    int expected, pending;    // arrivals per phase, arrivals still missing
    int64_t tx;               // transaction bytes announced and not yet completed
    const char* file;         // where it was initialised
    int line;
    std::vector<BulkCopy*> copies;   // copies in flight that complete transactions on it
};
// A bulk or tensor copy into shared memory: read at issue, landed when someone waits on its mbarrier.
struct BulkCopy {
    char* dst;
    std::vector<char> data;
    bool landed;
    const char* what;
    const char* file;
    int line;
};
// A bulk store from shared memory: its source read at the issuing thread's
// cp.async.bulk.wait_group.read (or plain wait), its destination written at the plain wait or
// when the thread exits.
struct BulkStore {
    char* dst;
    const char* src;          // shared memory
    size_t size;
    std::vector<std::pair<int64_t, int64_t>> map;   // tensor stores: (global, shared) byte offsets of the elements
                                                    // in bounds (none where the box is wholly outside)
    int elem;                 // a tensor store's element bytes; 0 for a plain bulk store, -1 for a
                              // bulk reduce-add of floats
    int group;                // bulk async-group, -1 until cp.async.bulk.commit_group
    AsyncOp* op;
    uint32_t pc;
    std::vector<char> data;   // the source's bytes, once a .read wait has read them (src then points here)
};
// A named barrier (bar.sync / bar.arrive with an id): threads counted per phase.
struct NamedBarrier {
    int expected;             // threads, 0 while idle
    int arrived;
    const char* file;
    int line;
};
struct Sm90Fiber {
    // wgmma: registers of wgmmas in flight, their ops (op, group), groups committed
    std::vector<WgReg> wg_regs;
    std::vector<std::pair<AsyncOp*, int>> wg_ops;
    int wg_groups;
    uintptr_t wg_lo, wg_hi;   // bounds of wg_regs' addresses
    uint32_t proxy_fences;    // fence.proxy.async executed
    std::vector<BulkStore> stores;
    int bulk_groups;
    uint32_t wait_mbar;       // F_WAIT_MBAR: the barrier and the phase parity (or phase) awaited
    uint64_t wait_phase;
    bool wait_parity;
    int wait_named;           // F_WAIT_NAMED: the barrier id
    int spins;                // consecutive failed mbarrier.test_wait
};
struct Sm90Block {
    int wg_arrived[8];                    // threads of each warpgroup waiting at a warpgroup instruction
    std::vector<AsyncOp*> ops;            // the block's async ops (freed with the block)
    std::vector<BulkCopy*> copies;        // likewise
    std::unordered_map<uint32_t, MBarrier> mbar;
    NamedBarrier named[16];
    int regs[8];                          // setmaxnreg: registers per thread of each warpgroup
    int reg_value[8], reg_count[8];       // the setmaxnreg a warpgroup's threads are executing
};

// A cp.async in flight: issued by its thread, landed by that thread's wait.
struct CpAsync {
    char* dst;
    const char* src;
    int cp_size, src_size;
    int group;          // commit-group number, -1 until cp.async.commit_group
    uint32_t pc;        // module-relative pc of the issue
    const char* file;
    int line;
};

struct Fiber {
    void* sp;
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    char* stack_lo;
    char* stack_hi;
    int state;
    int linear;
    uint3_ tid;
    const char* wfile;
    int wline;
    const void* wpc;  // the call site of an .aligned instruction (one asm line, inlined in many places)
    // warp op
    int op;
    unsigned mask;
    int arg, width;
    unsigned long long val, result;
    const void* gsrc;
    void* gdst;
    unsigned long gbytes;
    // cp.async groups: copies not yet landed, and how many groups were committed
    std::vector<CpAsync> cp;
    int cp_groups;
    // barrier op
    int bar_op;  // EmuBarrierOp
    Sm90Fiber sm90;
};

struct KernelEntry {
    const char* name;
    void (*invoke)(void* fn, void** argv);
    void* fn;
    int nparams;
    const int* params;  // pairs (size, kind)
};
extern "C" const KernelEntry __emu_kernel_table[];
extern "C" const int __emu_kernel_count;

struct Launch;

struct Worker {
    void* sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    Fiber* cur;
    std::vector<Fiber> fibers;
    char* stacks;
    size_t stacks_size;
    size_t stack_size;
    int nthreads;
    int live;
    int exited;
    int bar_count;
    int bar_sum, bar_and, bar_or;
    unsigned warp_waiting[32];
    unsigned warp_exist[32];
    unsigned warp_exited[32];
    unsigned warp_sync[32];
    Sm90Block sm90;                 // wgmma, mbarriers, bulk copies, named barriers (sm90.cpp)
    uint32_t epoch;
    uint32_t block_epoch;           // the epoch the block began in: shadow records older than it are stale
    Launch* L;
    int block_linear;
    uint3_ block;
    sigjmp_buf jb;
    volatile int in_fiber;
};

extern thread_local Worker* __emu_t_worker;

struct Range {
    uintptr_t lo, hi;
    int arg;
    uint64_t read = 0, written = 0;   // checked mode: bytes of the argument accessed
};
struct SShadow;
struct GRegion { uintptr_t lo, hi; int32_t* wr; int32_t* rd; SShadow* sh; };

struct Launch {
    const KernelEntry* k;
    void** argv;
    unsigned grid[3], block[3];
    unsigned long long shmem;
    int checked, schedule;
    unsigned long long seed;
    std::atomic<long> next_block;
    long nblocks;
    std::atomic<int> failed;
    std::atomic<int> cancelled;  // the caller gave up (Ctrl-C): stop at the next fiber switch or block
    std::mutex err_mu;
    EmuError* err;
    EmuError record;   // the launch's own: __emu_launch_end copies it out
    std::vector<Range> args;
    std::vector<GRegion> regions;
    std::vector<std::thread> workers;
    bool handlers = false;   // install_signals() was called
    int running = 0;         // workers not yet finished
    std::mutex run_mu;
    std::condition_variable run_cv;
};

struct SShadow {
    int32_t w_tid;      // last writer (linear thread id), -1 none
    uint32_t w_epoch;   // barrier epoch of that write
    uint32_t w_wsync;   // writer's warp sync count at the write
    int32_t r_tid;      // reader since: -1 none, -2 several
    uint32_t r_epoch;
    uint32_t r_wsync;
    int16_t r_warp;     // warp of readers, -2 several warps
    uint16_t pend;      // 1 + linear id of a thread whose cp.async to this byte may be in flight
    uint32_t w_pc, r_pc; // module-relative pcs of the accesses
    uint32_t w_fence;   // the writer's fence.proxy.async count at the write
    uint32_t async_rd;  // 1 + index in sm90.ops of the last asynchronous operation that read it
    uint32_t bulk_wr;   // 1 + index in sm90.copies of the last bulk copy that writes it
};  // all-zero bytes mean "no access recorded" (epoch 0 is never current)


struct StmatrixCall { EmuStmatrixLane lane; int num, trans; };

// runtime.cpp
extern uintptr_t g_module_base;
void aligned_op(Worker* w, Fiber* f, int op, void* call, const void* pc, const char* file, int line);
uint64_t rel_pc(const void* pc);
EmuError* begin_error(Worker* w, int code);
void emsg(EmuError* e, const char* fmt, ...);
void switch_to_sched(Worker* w);
[[noreturn]] void abort_fiber(Worker* w);
[[noreturn]] void ptx_fail(Worker* w, int code, const char* fmt, ...);
uintptr_t tls_base();
uintptr_t shared_ptr(Worker* w, uint64_t addr, bool generic, int size);
bool shared_region(Worker* w, uintptr_t p, int size, uintptr_t* lo, uintptr_t* hi);
SShadow* shared_shadow(Worker* w, uintptr_t a, int* space, int64_t* off);
void check_access(uintptr_t a, int size, bool wr, void* pc, bool atomic = false);
void new_epoch(Worker* w);
unsigned long long warp_op_common(Worker* w, Fiber* f, int op, unsigned mask, const char* file, int line);

// sm90.cpp
void sm90_block_begin(Worker* w);
void sm90_worker_end(Worker* w);
void sm90_fiber_begin(Fiber* f);
void sm90_fiber_end(Worker* w, Fiber* f);   // its bulk stores land
void sm90_guard(Worker* w, Fiber* f, uintptr_t a, int size, bool wr, void* pc);   // checked: a fiber's own memory
void sm90_shared_access(Worker* w, SShadow& s, uintptr_t a, int size, bool wr, void* pc);   // checked: one byte
bool sm90_progress(Worker* w);        // no fiber can run: land copies in flight; true if that woke one
void sm90_describe(Worker* w, EmuError* e, const Fiber& f);   // what a waiting fiber waits for
const char* sm90_wait_name(const Fiber& f);

#endif
