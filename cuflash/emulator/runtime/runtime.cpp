// cuflash CPU emulator runtime: fibers (one per CUDA thread), block scheduler, barriers,
// warp primitives, deadlock reports, segfault capture, and the checked-mode access hooks
// (ThreadSanitizer-style instrumentation calls, implemented here; no sanitizer runtime).
// Compiled WITHOUT instrumentation and linked into every emulated kernel library.
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <signal.h>
#include <setjmp.h>
#include <unistd.h>
#include <time.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>
#include <algorithm>

#include "runtime.h"
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// These match `uint3`/`dim3` (three unsigned ints) used by the shim.
extern "C" {
thread_local uint3_ __emu_threadIdx;
thread_local uint3_ __emu_blockIdx;
thread_local dim3_ __emu_blockDim;
thread_local dim3_ __emu_gridDim;
}

extern "C" {
// 1024-byte aligned: the largest alignment a swizzle pattern (wgmma, TMA) asks of shared memory
__attribute__((visibility("default"), aligned(1024))) thread_local unsigned char __emu_dyn_smem[EMU_DYN_SMEM_MAX];
__attribute__((visibility("default"))) thread_local char __emu_tls_anchor;
}

// ------------------------------------------------------------------------------------------
// Context switching
#if defined(__x86_64__)
extern "C" void __emu_ctx_switch(void** save_sp, void* new_sp);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".hidden __emu_ctx_switch\n"
    ".globl __emu_ctx_switch\n"
    ".type __emu_ctx_switch,@function\n"
    "__emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    // MXCSR / x87 control word are not switched: device code never changes rounding modes,
    // and all fibers start from the same defaults (saves ~30 ns per switch)
    "  subq $8, %rsp\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size __emu_ctx_switch, .-__emu_ctx_switch\n");
#endif

static const char* op_name(int op) {
    static const char* n[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                              "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp",
                              "__cuflash_emu_warp_allgather", "mma.sync", "ldmatrix", "wgmma.mma_async",
                              "stmatrix", "setmaxnreg"};
    return (op >= EMU_WARP_SHFL_IDX && op <= EMU_WG_SETMAXNREG) ? n[op] : "warp op";
}

thread_local Worker* __emu_t_worker = nullptr;

static bool stopping(const Launch* L) {
    return L->failed.load(std::memory_order_relaxed) || L->cancelled.load(std::memory_order_relaxed);
}

uintptr_t g_module_base = 0;
static std::vector<std::pair<uintptr_t, uintptr_t>> g_module_ranges;  // PT_LOAD segments
static size_t g_tls_memsz = 0;
static std::vector<std::pair<int64_t, int64_t>> g_static_shared;    // (TLS offset, size)
static int64_t g_anchor_off = 0;
static int64_t g_static_lo_off = 0, g_static_hi_off = 0;
static size_t g_stack_kb = 256;
static std::atomic<unsigned> g_shadow_epoch{1};

// A synchronisation point for checked mode: accesses before it and after it do not race.
void new_epoch(Worker* w) {
    w->epoch = g_shadow_epoch.fetch_add(1) + 1;
    for (int i = 0; i < 32; ++i) w->warp_sync[i] = 0;
}

uintptr_t tls_base() { return (uintptr_t)&__emu_tls_anchor - (uintptr_t)g_anchor_off; }

static int phdr_cb(struct dl_phdr_info* info, size_t, void*) {
    if (info->dlpi_addr != g_module_base) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD)
            g_module_ranges.push_back({info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz});
        if (ph.p_type == PT_TLS) g_tls_memsz = ph.p_memsz;
    }
    return 1;
}

EMU_EXPORT int __emu_init(int64_t anchor_off, int nstatic, const int64_t* stat /* off,size pairs */,
                          int stack_kb) {
    Dl_info di;
    if (dladdr((void*)&__emu_init, &di) && di.dli_fbase) g_module_base = (uintptr_t)di.dli_fbase;
    g_module_ranges.clear();
    dl_iterate_phdr(phdr_cb, nullptr);
    g_anchor_off = anchor_off;
    g_static_shared.clear();
    g_static_lo_off = INT64_MAX;
    g_static_hi_off = INT64_MIN;
    for (int i = 0; i < nstatic; ++i) {
        g_static_shared.push_back({stat[2 * i], stat[2 * i + 1]});
        g_static_lo_off = std::min(g_static_lo_off, stat[2 * i]);
        g_static_hi_off = std::max(g_static_hi_off, stat[2 * i] + stat[2 * i + 1]);
    }
    if (nstatic == 0) g_static_lo_off = g_static_hi_off = 0;
    if (stack_kb > 0) g_stack_kb = (size_t)stack_kb;
    return __emu_kernel_count;
}

// Python checks its ctypes mirror of EmuError against this at load time.
EMU_EXPORT int __emu_error_record_size(void) { return (int)sizeof(EmuError); }

EMU_EXPORT int __emu_kernel_info(int k, const char** name, int* nparams, const int** params) {
    if (k < 0 || k >= __emu_kernel_count) return -1;
    *name = __emu_kernel_table[k].name;
    *nparams = __emu_kernel_table[k].nparams;
    *params = __emu_kernel_table[k].params;
    return 0;
}

// ------------------------------------------------------------------------------------------
// error reporting
uint64_t rel_pc(const void* pc) { return pc ? (uint64_t)((uintptr_t)pc - g_module_base) : 0; }

static void fill_ids(Worker* w, EmuError* e) {
    e->block[0] = w->block.x; e->block[1] = w->block.y; e->block[2] = w->block.z;
    if (w->cur) { e->thread[0] = w->cur->tid.x; e->thread[1] = w->cur->tid.y; e->thread[2] = w->cur->tid.z; }
}

// Returns the error record to fill, or null when another error was already recorded.
EmuError* begin_error(Worker* w, int code) {
    Launch* L = w->L;
    std::lock_guard<std::mutex> g(L->err_mu);
    if (L->failed.load()) return nullptr;
    L->failed.store(1);
    EmuError* e = L->err;
    memset(e, 0, sizeof(*e));
    e->code = code;
    e->arg_index = -1;
    fill_ids(w, e);
    return e;
}

void emsg(EmuError* e, const char* fmt, ...) {
    size_t n = strlen(e->msg);
    if (n + 1 >= sizeof(e->msg)) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg + n, sizeof(e->msg) - n, fmt, ap);
    va_end(ap);
}

void switch_to_sched(Worker* w) {
    Fiber* f = w->cur;
#if defined(__x86_64__)
    __emu_ctx_switch(&f->sp, w->sched_sp);
#else
    swapcontext(&f->uc, &w->sched_uc);
#endif
}

[[noreturn]] void abort_fiber(Worker* w) {
    w->cur->state = F_ABORTED;
    switch_to_sched(w);
    __builtin_trap();  // never resumed
}

// ------------------------------------------------------------------------------------------
// fibers
static void fiber_main();
#if defined(__x86_64__)
extern "C" void __emu_fiber_entry() { fiber_main(); }
#else
static void fiber_entry_uc() { fiber_main(); }
#endif

static void barrier_check_release(Worker* w);

static void fiber_main() {
    Worker* w = __emu_t_worker;
    Launch* L = w->L;
    L->k->invoke(L->k->fn, L->argv);
    w = __emu_t_worker;
    Fiber* f = w->cur;
    sm90_fiber_end(w, f);
    f->state = F_EXITED;
    w->live--;
    w->exited++;
    w->warp_exited[f->linear >> 5] |= 1u << (f->linear & 31);
    barrier_check_release(w);
    switch_to_sched(w);
    __builtin_trap();
}

// One stack per thread of the block, each above a guard page.
static bool map_stacks(Worker* w, int n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t ss = (g_stack_kb * 1024 + page - 1) / page * page;
    size_t need = (size_t)n * (ss + page);
    void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { w->stacks = nullptr; return false; }
    w->stacks = (char*)p;
    w->stacks_size = need;
    w->stack_size = ss;
    for (int i = 0; i < n; ++i) mprotect(w->stacks + (size_t)i * (ss + page), page, PROT_NONE);  // guard
    return true;
}

static void init_fiber(Worker* w, Fiber* f, int i) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    f->stack_lo = w->stacks + (size_t)i * (w->stack_size + page) + page;
    f->stack_hi = f->stack_lo + w->stack_size;
#if defined(__x86_64__)
    uint64_t* top = (uint64_t*)((uintptr_t)f->stack_hi & ~(uintptr_t)15);
    top[-1] = 0;
    top[-2] = (uint64_t)(uintptr_t)&__emu_fiber_entry;
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    uint32_t mx = 0x1F80;
    uint16_t cw = 0x037F;
    uint64_t ctl = 0;
    memcpy(&ctl, &mx, 4);
    memcpy((char*)&ctl + 4, &cw, 2);
    top[-9] = ctl;
    f->sp = &top[-9];
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack_lo;
    f->uc.uc_stack.ss_size = w->stack_size;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, fiber_entry_uc, 0);
#endif
}

// ------------------------------------------------------------------------------------------
// barriers
static const char* basename_(const char* p) {
    if (!p) return "?";
    const char* s = strrchr(p, '/');
    return s ? s + 1 : p;
}

static void release_barrier(Worker* w) {
    int sum = w->bar_sum, all = w->bar_and, any = w->bar_or;
    for (int i = 0; i < w->nthreads; ++i) {
        Fiber& f = w->fibers[i];
        if (f.state != F_WAIT_BAR) continue;
        f.state = F_RUNNABLE;
        f.result = f.bar_op == EMU_BARRIER_COUNT ? (unsigned long long)sum
                 : f.bar_op == EMU_BARRIER_AND ? (unsigned long long)all
                 : f.bar_op == EMU_BARRIER_OR ? (unsigned long long)any : 0ull;
    }
    w->bar_count = 0;
    w->bar_sum = 0; w->bar_and = 1; w->bar_or = 0;
    new_epoch(w);
}

static void barrier_check_release(Worker* w) {
    if (w->bar_count == 0 || w->bar_count < w->live) return;
    if (w->L->checked && w->exited > 0) {
        // Some threads left the kernel while others wait at __syncthreads: undefined behaviour in
        // CUDA (the barrier must be reached by every thread of the block); report it.
        EmuError* e = begin_error(w, EMU_ERROR_DEADLOCK);
        if (e) {
            const Fiber* any = nullptr;
            for (auto& f : w->fibers) if (f.state == F_WAIT_BAR) { any = &f; break; }
            emsg(e, "block (%u,%u,%u): divergent __syncthreads(): %d thread(s) wait at %s:%d but %d thread(s) "
                    "of the block already exited (e.g. thread ",
                 w->block.x, w->block.y, w->block.z, w->bar_count, any ? any->wfile : "?", any ? any->wline : 0,
                 w->exited);
            for (auto& f : w->fibers) if (f.state == F_EXITED) { emsg(e, "(%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z); break; }
            emsg(e, "). Every thread of a block must reach each __syncthreads().");
        }
        return;  // the scheduler stops on the recorded error
    }
    release_barrier(w);
}

EMU_EXPORT int __emu_syncthreads_op(int op, int pred, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    f->state = F_WAIT_BAR;
    f->wfile = file;
    f->wline = line;
    f->bar_op = op;
    w->bar_count++;
    w->bar_sum += pred;
    w->bar_and &= pred;
    w->bar_or |= pred;
    barrier_check_release(w);
    switch_to_sched(w);
    return (int)f->result;
}

EMU_EXPORT void __emu_syncthreads(const char* file, int line) { __emu_syncthreads_op(EMU_BARRIER_PLAIN, 0, file, line); }

// ------------------------------------------------------------------------------------------
// warp primitives
static void aligned_compute(Worker* w, int warp, unsigned group);

static void warp_compute(Worker* w, int warp, unsigned group) {
    Fiber* base = &w->fibers[warp * 32];
    for (unsigned m = group; m; m &= m - 1)
        if (base[__builtin_ctz(m)].op >= EMU_WARP_MMA) {
            aligned_compute(w, warp, group);
            for (unsigned m2 = group; m2; m2 &= m2 - 1) base[__builtin_ctz(m2)].state = F_RUNNABLE;
            w->warp_waiting[warp] &= ~group;
            w->warp_sync[warp]++;
            return;
        }
    unsigned ballot = 0;
    for (unsigned m = group; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        if (base[l].val) ballot |= 1u << l;
    }
    for (unsigned m = group; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        Fiber& f = base[l];
        int wd = f.width;
        if (wd <= 0 || wd > 32 || (wd & (wd - 1))) wd = 32;
        int seg = l & ~(wd - 1);
        int src = l;
        switch (f.op) {
            case EMU_WARP_SHFL_IDX: src = seg + (f.arg & (wd - 1)); break;
            case EMU_WARP_SHFL_UP: src = l - f.arg; if (src < seg) src = l; break;
            case EMU_WARP_SHFL_DOWN: src = l + f.arg; if (src >= seg + wd) src = l; break;
            case EMU_WARP_SHFL_XOR: src = l ^ f.arg; if (src < seg || src >= seg + wd) src = l; break;
            default: break;
        }
        switch (f.op) {
            case EMU_WARP_SHFL_IDX: case EMU_WARP_SHFL_UP: case EMU_WARP_SHFL_DOWN: case EMU_WARP_SHFL_XOR:
                f.result = (src >= 0 && src < 32 && (group >> src & 1)) ? base[src].val : f.val;
                break;
            case EMU_WARP_BALLOT: f.result = ballot & f.mask; break;
            case EMU_WARP_ANY: f.result = (ballot & f.mask) != 0; break;
            case EMU_WARP_ALL: f.result = (ballot & f.mask) == (f.mask & group); break;
            case EMU_WARP_ALLGATHER:
                for (unsigned m2 = group; m2; m2 &= m2 - 1) {
                    int s = __builtin_ctz(m2);
                    if (base[s].op == EMU_WARP_ALLGATHER && base[s].gbytes == f.gbytes)
                        memcpy((char*)f.gdst + (size_t)s * f.gbytes, base[s].gsrc, f.gbytes);
                }
                f.result = 0;
                break;
            default: f.result = 0; break;
        }
    }
    for (unsigned m = group; m; m &= m - 1) base[__builtin_ctz(m)].state = F_RUNNABLE;
    w->warp_waiting[warp] &= ~group;
    w->warp_sync[warp]++;
}

static void warp_try_release(Worker* w, int warp, unsigned mask) {
    if ((w->warp_waiting[warp] & mask) == mask) warp_compute(w, warp, mask);
}

unsigned long long warp_op_common(Worker* w, Fiber* f, int op, unsigned mask, const char* file, int line) {
    int lane = f->linear & 31, warp = f->linear >> 5;
    mask &= w->warp_exist[warp];
    if (!(mask >> lane & 1)) {
        if (w->L->checked) {
            EmuError* e = begin_error(w, EMU_ERROR_GENERIC);
            if (e) emsg(e, "%s at %s:%d: the calling lane %d is not in the member mask 0x%08x",
                        op_name(op), file, line, lane, mask);
            abort_fiber(w);
        }
        mask |= 1u << lane;
    }
    f->op = op;
    f->mask = mask;
    f->wfile = file;
    f->wline = line;
    f->state = F_WAIT_WARP;
    w->warp_waiting[warp] |= 1u << lane;
    warp_try_release(w, warp, mask);
    switch_to_sched(w);
    return f->result;
}

EMU_EXPORT unsigned long long __emu_warp_op(int op, unsigned mask, unsigned long long val, int arg, int width,
                                            const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    f->val = val;
    f->arg = arg;
    f->width = width;
    return warp_op_common(w, f, op, mask, file, line);
}

EMU_EXPORT void __emu_warp_allgather(unsigned mask, const void* src, void* dst, unsigned long bytes,
                                     const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    f->val = 0;
    f->gsrc = src;
    f->gdst = dst;
    f->gbytes = bytes;
    warp_op_common(w, f, EMU_WARP_ALLGATHER, mask, file, line);
}

EMU_EXPORT unsigned __emu_activemask(void) {
    Worker* w = __emu_t_worker;
    int warp = w->cur->linear >> 5;
    return w->warp_exist[warp] & ~w->warp_exited[warp];
}

EMU_EXPORT unsigned long long __emu_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

EMU_EXPORT void __emu_trap(const char* what, const char* file, int line) {
    Worker* w = __emu_t_worker;
    if (!w || !w->cur) { fprintf(stderr, "%s at %s:%d outside a kernel launch\n", what, file, line); abort(); }
    EmuError* e = begin_error(w, EMU_ERROR_TRAP);
    if (e) emsg(e, "%s at %s:%d", what, file, line);
    abort_fiber(w);
}

// Device-side assert(): glibc's assert calls __assert_fail; -Bsymbolic binds the kernel's
// calls to this definition, so a failing assert ends the launch with an error instead of abort().
extern "C" __attribute__((visibility("default"), noreturn)) void __assert_fail(
    const char* expr, const char* file, unsigned int line, const char* func) noexcept {
    Worker* w = __emu_t_worker;
    if (!w || !w->cur) { fprintf(stderr, "%s:%u: %s: Assertion `%s' failed.\n", file, line, func, expr); abort(); }
    EmuError* e = begin_error(w, EMU_ERROR_TRAP);
    if (e) emsg(e, "device assertion `%s` failed at %s:%u in %s", expr, file, line, func);
    abort_fiber(w);
}

// ------------------------------------------------------------------------------------------
// checked mode: shared-memory race detection, bounds checks, inter-block global races
static thread_local SShadow* __emu_t_dyn_shadow = nullptr;
static thread_local SShadow* __emu_t_stat_shadow = nullptr;

// The earlier access a race conflicts with: by thread `thread` (linear id; -1: several threads)
// of block `block` (linear id; -1: several blocks).
struct Conflict { long block; int thread; bool is_write; uint64_t pc; };

static void block_coords(const Launch* L, long b, int32_t out[3]) {
    if (b < 0) { out[0] = out[1] = out[2] = -1; return; }
    out[0] = (int32_t)(b % L->grid[0]);
    out[1] = (int32_t)((b / L->grid[0]) % L->grid[1]);
    out[2] = (int32_t)(b / ((long)L->grid[0] * L->grid[1]));
}

[[noreturn]] static void report_race(Worker* w, int space, int64_t off, uintptr_t addr, int size, bool is_write,
                                     Conflict other, void* pc) {
    EmuError* e = begin_error(w, EMU_ERROR_RACE);
    if (e) {
        e->space = space;
        e->offset = off;
        e->addr = addr;
        e->size = size;
        e->is_write = is_write;
        e->pc = rel_pc(pc);
        e->other_is_write = other.is_write;
        e->other_pc = other.pc;
        block_coords(w->L, other.block, e->other_block);
        e->other_thread[0] = e->other_thread[1] = e->other_thread[2] = -1;
        if (other.thread >= 0 && other.block == w->block_linear) {
            const Fiber& o = w->fibers[other.thread];
            e->other_thread[0] = o.tid.x; e->other_thread[1] = o.tid.y; e->other_thread[2] = o.tid.z;
        }
        if (space == EMU_SPACE_GLOBAL) {
            for (auto& r : w->L->args)
                if (addr >= r.lo && addr < r.hi) { e->arg_index = r.arg; e->offset = (int64_t)(addr - r.lo); break; }
        }
    }
    abort_fiber(w);
}

static inline bool ordered(Worker* w, int me, int other, uint32_t wsync) {
    return (me >> 5) == (other >> 5) && w->warp_sync[me >> 5] > wsync;
}

static const CpAsync* cp_in_flight(Worker* w, int tid, uintptr_t a);
[[noreturn]] static void report_pending(Worker* w, int space, int64_t off, uintptr_t addr, int size, bool wr,
                                        int issuer, const CpAsync* cp, void* pc);

static void shared_access(Worker* w, SShadow* sh, int space, int64_t off, uintptr_t addr, int size, bool wr, void* pc) {
    int me = w->cur->linear;
    uint32_t ep = w->epoch;
    unsigned ws = w->warp_sync[me >> 5];
    for (int b = 0; b < size; ++b) {
        SShadow& s = sh[b];
        if (s.pend) {
            // a cp.async lands at its thread's wait: until then nobody may touch its bytes
            const CpAsync* cp = cp_in_flight(w, s.pend - 1, addr + b);
            if (cp) report_pending(w, space, off + b, addr + b, size, wr, s.pend - 1, cp, pc);
            s.pend = 0;
        }
        if (s.async_rd | s.bulk_wr) sm90_shared_access(w, s, addr + b, size, wr, pc);   // asynchronous operations
        if (s.w_tid >= 0 && s.w_epoch == ep && s.w_tid != me && !ordered(w, me, s.w_tid, s.w_wsync))
            report_race(w, space, off + b, addr + b, size, wr, {w->block_linear, s.w_tid, true, s.w_pc}, pc);
        if (wr) {
            if (s.r_tid != -1 && s.r_epoch == ep) {
                if (s.r_tid >= 0 && s.r_tid != me && !ordered(w, me, s.r_tid, s.r_wsync))
                    report_race(w, space, off + b, addr + b, size, wr, {w->block_linear, s.r_tid, false, s.r_pc}, pc);
                if (s.r_tid == -2 && !(s.r_warp == (me >> 5) && ws > s.r_wsync))
                    report_race(w, space, off + b, addr + b, size, wr, {w->block_linear, -1, false, s.r_pc}, pc);
            }
            s.w_tid = me; s.w_epoch = ep; s.w_wsync = ws; s.w_pc = (uint32_t)rel_pc(pc);
            s.w_fence = w->cur->sm90.proxy_fences;
            s.r_tid = -1;
        } else {
            if (s.r_tid == -1 || s.r_epoch != ep) {
                s.r_tid = me; s.r_epoch = ep; s.r_wsync = ws; s.r_warp = (int16_t)(me >> 5); s.r_pc = (uint32_t)rel_pc(pc);
            } else if (s.r_tid != me) {
                if (s.r_warp != (me >> 5)) s.r_warp = -2;
                s.r_tid = -2;
            }
        }
    }
}

static void report_bounds(Worker* w, int space, uintptr_t addr, int size, bool wr, int64_t off, void* pc) {
    EmuError* e = begin_error(w, EMU_ERROR_BOUNDS);
    if (!e) abort_fiber(w);
    e->space = space;
    e->addr = addr;
    e->size = size;
    e->is_write = wr;
    e->pc = rel_pc(pc);
    e->offset = off;
    if (space == EMU_SPACE_GLOBAL) {
        // nearest argument array
        Launch* L = w->L;
        uint64_t best = UINT64_MAX;
        for (auto& r : L->args) {
            uint64_t d = addr < r.lo ? r.lo - addr : (addr >= r.hi ? addr - r.hi + 1 : 0);
            if (d < best) { best = d; e->arg_index = r.arg; e->offset = (int64_t)(addr - r.lo); }
        }
    }
    abort_fiber(w);
}

static void global_access(Worker* w, uintptr_t a, int size, bool wr, void* pc, bool atomic) {
    Launch* L = w->L;
    for (auto& r : L->args)   // traffic per argument (one worker in checked mode)
        if (a >= r.lo && a < r.hi) (wr ? r.written : r.read) += size;
    for (auto& g : L->regions) {
        if (a >= g.lo && a + size <= g.hi) {
            if (atomic) return;
            int32_t me = w->block_linear + 1;
            size_t o = a - g.lo;
            for (int b = 0; b < size; ++b) {
                int32_t& wb = g.wr[o + b];
                int32_t& rb = g.rd[o + b];
                // another block wrote it, or (for a write) read it, earlier in this launch
                if (wb != 0 && wb != me)
                    report_race(w, EMU_SPACE_GLOBAL, (int64_t)(o + b), a + b, size, wr, {wb - 1, -1, true, 0}, pc);
                if (wr) {
                    if (rb != 0 && rb != me)
                        report_race(w, EMU_SPACE_GLOBAL, (int64_t)(o + b), a + b, size, wr,
                                    {rb > 0 ? rb - 1 : -1, -1, false, 0}, pc);
                    wb = me;
                } else {
                    if (rb == 0) rb = me;
                    else if (rb != me) rb = -1;
                }
            }
            // races between threads of this block (no barrier between their accesses)
            if (g.sh) shared_access(w, g.sh + o, EMU_SPACE_GLOBAL, (int64_t)o, a, size, wr, pc);
            return;
        }
    }
    // not inside an argument array: ignore the emulator's own memory (fiber stacks, module image,
    // the module's thread-local block), report everything else
    if (a >= (uintptr_t)w->stacks && a < (uintptr_t)w->stacks + w->stacks_size) return;
    for (auto& r : g_module_ranges) if (a >= r.first && a < r.second) return;
    uintptr_t tb = tls_base();
    if (a >= tb && a < tb + g_tls_memsz) return;
    report_bounds(w, EMU_SPACE_GLOBAL, a, size, wr, 0, pc);
}


void check_access(uintptr_t a, int size, bool wr, void* pc, bool atomic) {
    Worker* w = __emu_t_worker;
    if (!w || !w->in_fiber || !w->cur || !w->L->checked) return;
    // fiber stacks: private, but for the registers a wgmma in flight owns
    if (a < w->cur->sm90.wg_hi && a + size > w->cur->sm90.wg_lo) sm90_guard(w, w->cur, a, size, wr, pc);
    if (a - (uintptr_t)w->stacks < w->stacks_size) return;
    uintptr_t dyn = (uintptr_t)__emu_dyn_smem;
    if (a - dyn < (uintptr_t)EMU_DYN_SMEM_MAX) {
        int64_t off = (int64_t)(a - dyn);
        if ((unsigned long long)off + size > w->L->shmem)
            report_bounds(w, EMU_SPACE_SHARED_DYNAMIC, a, size, wr, off, pc);
        if (!atomic) shared_access(w, __emu_t_dyn_shadow + off, EMU_SPACE_SHARED_DYNAMIC, off, a, size, wr, pc);
        return;
    }
    if (!g_static_shared.empty()) {
        uintptr_t tb = tls_base();
        if (a >= tb + g_static_lo_off && a < tb + g_static_hi_off) {
            int64_t off = (int64_t)(a - tb);
            if (a + size > tb + g_static_hi_off) report_bounds(w, EMU_SPACE_SHARED_STATIC, a, size, wr, off, pc);
            if (!atomic) shared_access(w, __emu_t_stat_shadow + (off - g_static_lo_off), EMU_SPACE_SHARED_STATIC, off, a, size, wr, pc);
            return;
        }
    }
    global_access(w, a, size, wr, pc, atomic);
}

#define EMU_HOOK(N)                                                                                     \
    EMU_EXPORT void __tsan_read##N(void* a) { check_access((uintptr_t)a, N, false, __builtin_return_address(0)); } \
    EMU_EXPORT void __tsan_write##N(void* a) { check_access((uintptr_t)a, N, true, __builtin_return_address(0)); } \
    EMU_EXPORT void __tsan_unaligned_read##N(void* a) { check_access((uintptr_t)a, N, false, __builtin_return_address(0)); } \
    EMU_EXPORT void __tsan_unaligned_write##N(void* a) { check_access((uintptr_t)a, N, true, __builtin_return_address(0)); } \
    EMU_EXPORT void __tsan_volatile_read##N(void* a) { check_access((uintptr_t)a, N, false, __builtin_return_address(0)); } \
    EMU_EXPORT void __tsan_volatile_write##N(void* a) { check_access((uintptr_t)a, N, true, __builtin_return_address(0)); }
EMU_HOOK(1)
EMU_HOOK(2)
EMU_HOOK(4)
EMU_HOOK(8)
EMU_HOOK(16)
EMU_EXPORT void __tsan_read_range(void* a, unsigned long n) { check_access((uintptr_t)a, (int)n, false, __builtin_return_address(0)); }
EMU_EXPORT void __tsan_write_range(void* a, unsigned long n) { check_access((uintptr_t)a, (int)n, true, __builtin_return_address(0)); }
EMU_EXPORT void __tsan_init(void) {}
EMU_EXPORT void __tsan_func_entry(void*) {}
EMU_EXPORT void __tsan_func_exit(void) {}
EMU_EXPORT void __tsan_vptr_update(void**, void*) {}
EMU_EXPORT void __tsan_vptr_read(void**) {}

EMU_EXPORT void __emu_atomic_check(const void* p, unsigned long size, const char*, int) {
    check_access((uintptr_t)p, (int)size, true, __builtin_return_address(0), true);
}

// ------------------------------------------------------------------------------------------
// inline PTX (cuflash/emulator/_ptx.py emits the calls): shared-window addresses, the
// warp-wide mma.sync/ldmatrix, cp.async groups
[[noreturn]] void ptx_fail(Worker* w, int code, const char* fmt, ...) {
    EmuError* e = begin_error(w, code);
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    abort_fiber(w);
}

bool shared_region(Worker* w, uintptr_t p, int size, uintptr_t* lo, uintptr_t* hi);

// The address of `size` bytes at shared-window address `addr` (a generic pointer when
// `generic`), 0 unless they lie in a __shared__ variable or the launch's dynamic shared memory.
uintptr_t shared_ptr(Worker* w, uint64_t addr, bool generic, int size) {
    uintptr_t lo, hi;
    const uintptr_t p = generic ? (uintptr_t)addr : tls_base() + (uint32_t)addr;
    return shared_region(w, p, size, &lo, &hi) ? p : 0;
}

// The shared memory [lo, hi) that holds [p, p + size): the launch's dynamic shared memory or the
// __shared__ variables (false when neither does).
bool shared_region(Worker* w, uintptr_t p, int size, uintptr_t* lo, uintptr_t* hi) {
    const uintptr_t tb = tls_base(), dyn = (uintptr_t)__emu_dyn_smem;
    if (p >= dyn && p + size <= dyn + w->L->shmem) {
        *lo = dyn;
        *hi = dyn + w->L->shmem;
        return true;
    }
    if (!g_static_shared.empty() && p >= tb + g_static_lo_off && p + size <= tb + g_static_hi_off) {
        *lo = tb + g_static_lo_off;
        *hi = tb + g_static_hi_off;
        return true;
    }
    return false;
}

EMU_EXPORT size_t __emu_cvta_generic_to_shared(const void* p, const char* file, int line) {
    Worker* w = __emu_t_worker;
    const uintptr_t a = (uintptr_t)p, tb = tls_base(), dyn = (uintptr_t)__emu_dyn_smem;
    const bool in_static = !g_static_shared.empty() && a >= tb + g_static_lo_off && a <= tb + g_static_hi_off;
    if (!in_static && !(a >= dyn && a <= dyn + EMU_DYN_SMEM_MAX) && w && w->cur)
        ptx_fail(w, EMU_ERROR_BOUNDS, "__cvta_generic_to_shared at %s:%d: %p is not a shared-memory address", file,
                 line, p);
    return a - tb;
}

EMU_EXPORT void* __emu_cvta_shared_to_generic(size_t a) { return (void*)(tls_base() + (uint32_t)a); }

// A warp-wide .aligned instruction: every lane of a full warp meets at it.
struct MmaCall { EmuMmaLane lane; int k, type; EmuMmaArith arith; };
struct LdmatrixCall { EmuLdmatrixLane lane; int num, trans; };

void aligned_op(Worker* w, Fiber* f, int op, void* call, const void* pc, const char* file, int line) {
    const int warp = f->linear >> 5;
    if (w->warp_exist[warp] != 0xffffffffu)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: warp %d of the block has only %d thread(s); the .aligned "
                 "instruction needs all 32 lanes (make the block size a multiple of 32)", op_name(op), file, line,
                 warp, __builtin_popcount(w->warp_exist[warp]));
    f->gsrc = call;
    f->wpc = pc;
    warp_op_common(w, f, op, 0xffffffffu, file, line);
}

// Runs when all 32 lanes wait: they must wait at one and the same instruction.
static void aligned_compute(Worker* w, int warp, unsigned group) {
    Fiber* base = &w->fibers[warp * 32];
    const Fiber& f0 = base[__builtin_ctz(group)];
    for (unsigned m = group; m; m &= m - 1) {
        const Fiber& f = base[__builtin_ctz(m)];
        if (group != 0xffffffffu || f.op != f0.op || f.wline != f0.wline || strcmp(f.wfile, f0.wfile) ||
            (f.op >= EMU_WARP_MMA && f.wpc != f0.wpc)) {
            const Fiber& a = f0.op >= EMU_WARP_MMA ? f0 : f;
            const Fiber& b = f0.op >= EMU_WARP_MMA ? f : f0;
            EmuError* e = begin_error(w, EMU_ERROR_DEADLOCK);
            if (e) {
                emsg(e, "block (%u,%u,%u), warp %d: %s at %s:%d is .aligned, so all 32 lanes must execute it "
                        "together, but lane %d is at %s at %s:%d%s (divergent lanes)",
                     w->block.x, w->block.y, w->block.z, warp, op_name(a.op), a.wfile, a.wline, (int)(&b - base),
                     op_name(b.op), b.wfile, b.wline, b.op == a.op && b.wline == a.wline ? " from another call site" : "");
                e->thread[0] = a.tid.x; e->thread[1] = a.tid.y; e->thread[2] = a.tid.z;
                e->other_thread[0] = b.tid.x; e->other_thread[1] = b.tid.y; e->other_thread[2] = b.tid.z;
                e->pc = rel_pc(a.wpc);
                e->other_pc = b.op >= EMU_WARP_MMA ? rel_pc(b.wpc) : 0;
            }
            return;
        }
    }
    if (f0.op == EMU_WARP_MMA) {
        EmuMmaLane* lanes[32];
        for (int l = 0; l < 32; ++l) lanes[l] = &((MmaCall*)base[l].gsrc)->lane;
        const MmaCall* c = (const MmaCall*)f0.gsrc;
        emu_mma(c->k, c->type, c->arith, lanes);
    } else if (f0.op == EMU_WARP_LDMATRIX) {
        EmuLdmatrixLane* lanes[32];
        for (int l = 0; l < 32; ++l) lanes[l] = &((LdmatrixCall*)base[l].gsrc)->lane;
        const LdmatrixCall* c = (const LdmatrixCall*)f0.gsrc;
        emu_ldmatrix(c->num, c->trans, lanes);
    } else {
        EmuStmatrixLane* lanes[32];
        for (int l = 0; l < 32; ++l) lanes[l] = &((StmatrixCall*)base[l].gsrc)->lane;
        const StmatrixCall* c = (const StmatrixCall*)f0.gsrc;
        emu_stmatrix(c->num, c->trans, lanes);
    }
}

EMU_EXPORT void __emu_ptx_mma(int k, int type, const uint32_t* a, const uint32_t* b, const uint32_t* c, uint32_t* d,
                              int block_k, int extra_bits, int min_exponent, const char* file, int line) {
    Worker* w = __emu_t_worker;
    MmaCall call;
    memcpy(call.lane.a, a, sizeof(call.lane.a));
    memcpy(call.lane.b, b, sizeof(call.lane.b));
    memcpy(call.lane.c, c, sizeof(call.lane.c));
    call.lane.d = d;
    call.k = k;
    call.type = type;
    call.arith = {block_k, extra_bits, min_exponent};
    aligned_op(w, w->cur, EMU_WARP_MMA, &call, __builtin_return_address(0), file, line);
}

EMU_EXPORT void __emu_ptx_ldmatrix(int num, int trans, int generic, uint64_t addr, uint32_t* d, const char* file,
                                   int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    const int lane = f->linear & 31;
    LdmatrixCall call;
    memset(call.lane.row, 0, sizeof(call.lane.row));
    call.lane.d = d;
    call.num = num;
    call.trans = trans;
    if (lane < 8 * num) {   // lanes 8j..8j+7 address the rows of matrix j
        const char* space = generic ? "generic" : "shared";
        if (addr % 16)
            ptx_fail(w, EMU_ERROR_BOUNDS, "ldmatrix at %s:%d: lane %d gives row address 0x%llx (%s), which is not "
                     "16-byte aligned (each row is 16 bytes)", file, line, lane, (unsigned long long)addr, space);
        const uintptr_t p = shared_ptr(w, addr, generic, 16);
        if (!p)
            ptx_fail(w, EMU_ERROR_BOUNDS, "ldmatrix at %s:%d: lane %d gives row address 0x%llx (%s): its 16 bytes "
                     "are not inside a __shared__ variable or the launch's %llu bytes of dynamic shared memory",
                     file, line, lane, (unsigned long long)addr, space, w->L->shmem);
        if (w->L->checked) check_access(p, 16, false, __builtin_return_address(0));
        memcpy(call.lane.row, (const void*)p, 16);
    }
    aligned_op(w, f, EMU_WARP_LDMATRIX, &call, __builtin_return_address(0), file, line);
}

SShadow* shared_shadow(Worker* w, uintptr_t a, int* space, int64_t* off) {
    const uintptr_t dyn = (uintptr_t)__emu_dyn_smem;
    if (a - dyn < (uintptr_t)EMU_DYN_SMEM_MAX) {
        *space = EMU_SPACE_SHARED_DYNAMIC;
        *off = (int64_t)(a - dyn);
        return __emu_t_dyn_shadow + *off;
    }
    *space = EMU_SPACE_SHARED_STATIC;
    *off = (int64_t)(a - tls_base());
    return __emu_t_stat_shadow + (*off - g_static_lo_off);
}

static const CpAsync* cp_in_flight(Worker* w, int tid, uintptr_t a) {
    if (tid < 0 || tid >= w->nthreads) return nullptr;
    for (const CpAsync& c : w->fibers[tid].cp)
        if (a >= (uintptr_t)c.dst && a < (uintptr_t)c.dst + c.cp_size) return &c;
    return nullptr;
}

[[noreturn]] static void report_pending(Worker* w, int space, int64_t off, uintptr_t addr, int size, bool wr,
                                        int issuer, const CpAsync* cp, void* pc) {
    EmuError* e = begin_error(w, EMU_ERROR_RACE);
    if (e) {
        const Fiber& o = w->fibers[issuer];
        e->space = space;
        e->offset = off;
        e->addr = addr;
        e->size = size;
        e->is_write = wr;
        e->pc = rel_pc(pc);
        e->other_is_write = 1;
        e->other_pc = cp->pc;
        block_coords(w->L, w->block_linear, e->other_block);
        e->other_thread[0] = o.tid.x; e->other_thread[1] = o.tid.y; e->other_thread[2] = o.tid.z;
        emsg(e, "the cp.async at %s:%d by thread (%u,%u,%u) is still pending: its bytes land only at that thread's "
                "cp.async.wait_group/wait_all (and reach other threads after a barrier that follows the wait)",
             cp->file, cp->line, o.tid.x, o.tid.y, o.tid.z);
    }
    abort_fiber(w);
}

EMU_EXPORT void __emu_ptx_cp_async(uint64_t dst, uint64_t src, int cp_size, int src_size, int cg, const char* file,
                                   int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    void* pc = __builtin_return_address(0);
    const char* name = cg ? "cp.async.cg" : "cp.async.ca";
    if ((cp_size != 4 && cp_size != 8 && cp_size != 16) || (cg && cp_size != 16))
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: cp-size %d is not %s", name, file, line, cp_size,
                 cg ? "16" : "4, 8 or 16");
    if (src_size < 0 || src_size > cp_size)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: src-size %d is not in [0, cp-size %d]", name, file, line,
                 src_size, cp_size);
    if (dst % cp_size || src % cp_size)
        ptx_fail(w, EMU_ERROR_BOUNDS, "%s at %s:%d: the %s address 0x%llx is not aligned to cp-size %d", name, file,
                 line, dst % cp_size ? "destination (shared)" : "source (global)",
                 (unsigned long long)(dst % cp_size ? dst : src), cp_size);
    char* d = (char*)shared_ptr(w, dst, false, cp_size);
    if (!d)
        ptx_fail(w, EMU_ERROR_BOUNDS, "%s at %s:%d: the destination's %d bytes at shared address 0x%llx are not "
                 "inside a __shared__ variable or the launch's %llu bytes of dynamic shared memory", name, file, line,
                 cp_size, (unsigned long long)dst, w->L->shmem);
    if (w->L->checked) {
        if (src_size) check_access((uintptr_t)src, src_size, false, pc);
        check_access((uintptr_t)d, cp_size, true, pc);
        int space;
        int64_t off;
        SShadow* sh = shared_shadow(w, (uintptr_t)d, &space, &off);
        for (int b = 0; b < cp_size; ++b) sh[b].pend = (uint16_t)(f->linear + 1);
    }
    memset(d, 0xff, cp_size);   // NaN until the copy lands
    f->cp.push_back({d, (const char*)(uintptr_t)src, cp_size, src_size, -1, (uint32_t)rel_pc(pc), file, line});
}

EMU_EXPORT void __emu_ptx_cp_async_commit(void) {
    Fiber* f = __emu_t_worker->cur;
    for (CpAsync& c : f->cp)
        if (c.group < 0) c.group = f->cp_groups;
    f->cp_groups++;
}

// cp.async.wait_group n: every committed group but the n newest lands, in commit order.
EMU_EXPORT void __emu_ptx_cp_async_wait(int n, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    if (n < 0) ptx_fail(w, EMU_ERROR_GENERIC, "cp.async.wait_group at %s:%d: N = %d is negative", file, line, n);
    const int done = f->cp_groups - n;
    size_t keep = 0;
    for (size_t i = 0; i < f->cp.size(); ++i) {
        CpAsync c = f->cp[i];
        if (c.group < 0 || c.group >= done) {
            f->cp[keep++] = c;
            continue;
        }
        memcpy(c.dst, c.src, (size_t)c.src_size);
        memset(c.dst + c.src_size, 0, (size_t)(c.cp_size - c.src_size));   // src-size < cp-size zero-fills
        if (w->L->checked) {
            // the landing is this thread's write, made now: others need a barrier after it
            int space;
            int64_t off;
            SShadow* sh = shared_shadow(w, (uintptr_t)c.dst, &space, &off);
            const int me = f->linear;
            for (int b = 0; b < c.cp_size; ++b) {
                SShadow& s = sh[b];
                s.pend = 0;
                s.w_tid = me; s.w_epoch = w->epoch; s.w_wsync = w->warp_sync[me >> 5]; s.w_pc = c.pc;
                s.r_tid = -1;
            }
        }
    }
    f->cp.resize(keep);
}

// ------------------------------------------------------------------------------------------
// scheduler
static uint64_t rng_next(uint64_t& s) {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return s;
}

static void describe_deadlock(Worker* w) {
    EmuError* e = begin_error(w, EMU_ERROR_DEADLOCK);
    if (!e) return;
    e->thread[0] = e->thread[1] = e->thread[2] = -1;
    emsg(e, "deadlock in block (%u,%u,%u): no thread can make progress.\n", w->block.x, w->block.y, w->block.z);
    // group waiting threads by (kind, site)
    std::vector<char> done(w->nthreads, 0);
    int groups = 0;
    for (int i = 0; i < w->nthreads && groups < 24; ++i) {
        Fiber& f = w->fibers[i];
        if (done[i] || f.state == F_RUNNABLE || f.state == F_EXITED || f.state == F_ABORTED) continue;
        ++groups;
        int count = 0, first = i, last = i;
        for (int j = i; j < w->nthreads; ++j) {
            Fiber& g = w->fibers[j];
            if (done[j] || g.state != f.state || g.wfile != f.wfile || g.wline != f.wline ||
                (f.state != F_WAIT_BAR && g.op != f.op)) continue;
            done[j] = 1; ++count; last = j;
        }
        const char* what = f.state == F_WAIT_BAR ? "__syncthreads()" : f.state == F_WAIT_WARP || f.state == F_WAIT_WG
                         ? op_name(f.op) : sm90_wait_name(f);
        emsg(e, "  %d thread(s) wait in %s at %s:%d (threads with linear ids %d..%d",
             count, what, f.wfile ? f.wfile : "?", f.wline, first, last);
        sm90_describe(w, e, f);
        if (f.state == F_WAIT_WARP) {
            int warp = f.linear >> 5;
            unsigned missing = f.mask & ~w->warp_waiting[warp];
            emsg(e, ", warp %d, mask 0x%08x", warp, f.mask);
            if (missing) {
                int l = __builtin_ctz(missing);
                Fiber& m = w->fibers[warp * 32 + l];
                if (m.state == F_EXITED) emsg(e, "; lane %d of the mask has exited", l);
                else if (m.state == F_WAIT_BAR) emsg(e, "; lane %d of the mask waits in __syncthreads() at %s:%d", l, m.wfile, m.wline);
                else if (m.state == F_WAIT_WARP) emsg(e, "; lane %d of the mask waits in %s at %s:%d", l, op_name(m.op), m.wfile, m.wline);
            }
        }
        emsg(e, ")\n");
    }
    if (w->exited) emsg(e, "  %d thread(s) have exited.\n", w->exited);
}

static void run_block(Worker* w, long b) {
    Launch* L = w->L;
    w->block_linear = (int)b;
    w->block.x = (unsigned)(b % L->grid[0]);
    w->block.y = (unsigned)((b / L->grid[0]) % L->grid[1]);
    w->block.z = (unsigned)(b / ((long)L->grid[0] * L->grid[1]));
    __emu_blockIdx = w->block;
    __emu_blockDim = {L->block[0], L->block[1], L->block[2]};
    __emu_gridDim = {L->grid[0], L->grid[1], L->grid[2]};
    // shared memory starts as garbage on a GPU: NaN bit patterns here
    if (L->shmem) memset(__emu_dyn_smem, 0xff, L->shmem);
    uintptr_t tb = tls_base();
    for (auto& s : g_static_shared) memset((void*)(tb + s.first), 0xff, (size_t)s.second);
    int n = w->nthreads;
    w->live = n;
    w->exited = 0;
    w->bar_count = 0; w->bar_sum = 0; w->bar_and = 1; w->bar_or = 0;
    w->epoch = w->block_epoch = g_shadow_epoch.fetch_add(1) + 1;
    for (int i = 0; i < 32; ++i) { w->warp_waiting[i] = 0; w->warp_sync[i] = 0; w->warp_exited[i] = 0; w->warp_exist[i] = 0; }
    sm90_block_begin(w);
    for (int i = 0; i < n; ++i) {
        Fiber& f = w->fibers[i];
        f.state = F_RUNNABLE;
        f.linear = i;
        f.tid.x = (unsigned)(i % L->block[0]);
        f.tid.y = (unsigned)((i / L->block[0]) % L->block[1]);
        f.tid.z = (unsigned)(i / (L->block[0] * L->block[1]));
        f.wfile = nullptr; f.wline = 0;
        f.cp.clear();
        f.cp_groups = 0;
        sm90_fiber_begin(&f);
        w->warp_exist[i >> 5] |= 1u << (i & 31);
        init_fiber(w, &f, i);
    }
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = L->schedule == EMU_SCHEDULE_REVERSED ? n - 1 - i : i;
    uint64_t rs = (L->seed + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)b + 1) * 0xD1B54A32D192ED03ull;
    if (!rs) rs = 1;
    for (;;) {
        if (L->schedule == EMU_SCHEDULE_RANDOM)
            for (int i = n - 1; i > 0; --i) std::swap(order[i], order[rng_next(rs) % (uint64_t)(i + 1)]);
        bool ran = false;
        for (int k = 0; k < n; ++k) {
            Fiber& f = w->fibers[order[k]];
            if (f.state != F_RUNNABLE) continue;
            ran = true;
            w->cur = &f;
            __emu_threadIdx = f.tid;
            w->in_fiber = 1;
#if defined(__x86_64__)
            __emu_ctx_switch(&w->sched_sp, f.sp);
#else
            swapcontext(&w->sched_uc, &f.uc);
#endif
            w->in_fiber = 0;
            w->cur = nullptr;
            if (stopping(L)) return;   // the block's fibers are abandoned; their stacks go with the worker
        }
        if (w->live == 0) return;
        if (!ran) {
            // last chance: release any satisfiable warp group (should not be needed)
            bool rel = false;
            for (int wp = 0; wp * 32 < n; ++wp)
                for (int l = 0; l < 32; ++l) {
                    if (!(w->warp_waiting[wp] >> l & 1)) continue;
                    Fiber& f = w->fibers[wp * 32 + l];
                    if ((w->warp_waiting[wp] & f.mask) == f.mask) { warp_compute(w, wp, f.mask); rel = true; }
                }
            if (!rel && !sm90_progress(w)) { describe_deadlock(w); return; }
            if (stopping(L)) return;
        }
    }
}

// segfaults inside device code end the launch with an error instead of killing the process
static struct sigaction g_old_segv, g_old_bus;
static std::mutex g_sig_mu;
static int g_sig_users = 0;

static void segv_handler(int sig, siginfo_t* si, void* uc) {
    Worker* w = __emu_t_worker;
    if (w && w->in_fiber && w->cur) {
        EmuError* e = begin_error(w, EMU_ERROR_FAULT);
        if (e) {
            uintptr_t a = (uintptr_t)si->si_addr;
            e->addr = a;
            bool guard = false;
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            if (a >= (uintptr_t)w->stacks && a < (uintptr_t)w->stacks + w->stacks_size) {
                size_t o = (a - (uintptr_t)w->stacks) % (w->stack_size + page);
                guard = o < page;
            }
            if (guard)
                emsg(e, "fiber stack overflow (thread stack of %zu KiB exhausted); set CUFLASH_EMULATOR_STACK_KB "
                        "to a larger value", w->stack_size / 1024);
            else
                emsg(e, "%s: invalid memory access at address 0x%lx (run with checked=True or "
                        "CUFLASH_EMULATOR_CHECKED=1 to find the offending access)",
                     sig == SIGSEGV ? "segmentation fault" : "bus error", (unsigned long)a);
        }
        w->in_fiber = 0;
        siglongjmp(w->jb, 1);
    }
    // not ours: hand over to the previous handler
    struct sigaction* old = sig == SIGSEGV ? &g_old_segv : &g_old_bus;
    if (old->sa_flags & SA_SIGINFO) { if (old->sa_sigaction) { old->sa_sigaction(sig, si, uc); return; } }
    else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) { old->sa_handler(sig); return; }
    sigaction(sig, old, nullptr);
    raise(sig);
}

static void install_signals() {
    static const bool off = getenv("CUFLASH_EMULATOR_NO_SIGNALS") != nullptr;
    if (off) return;
    std::lock_guard<std::mutex> g(g_sig_mu);
    if (g_sig_users++ > 0) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = segv_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
}
static void remove_signals() {
    static const bool off = getenv("CUFLASH_EMULATOR_NO_SIGNALS") != nullptr;
    if (off) return;
    std::lock_guard<std::mutex> g(g_sig_mu);
    if (--g_sig_users > 0) return;
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
}

// One OS thread's share of a launch: it takes blocks from the launch until none is left.
// Fiber stacks and shadows live for this call only: each guard page is a separate mapping,
// and every loaded kernel library has its own runtime, so keeping them would exhaust
// vm.max_map_count in a long test session (re-mapping costs well under a millisecond).
static void worker_run(Launch* L) {
    Worker worker{};
    Worker* w = &worker;
    w->L = L;
    int n = (int)(L->block[0] * L->block[1] * L->block[2]);
    w->nthreads = n;
    w->fibers.resize(n);
    if (!map_stacks(w, n)) {
        EmuError* e = begin_error(w, EMU_ERROR_GENERIC);
        if (e) emsg(e, "cannot allocate fiber stacks for %d threads", n);
        return;
    }
    // alternate signal stack so that a fiber stack overflow can still be reported
    std::vector<char> altstack(64 * 1024);
    stack_t ss, old_ss;
    ss.ss_sp = altstack.data(); ss.ss_size = altstack.size(); ss.ss_flags = 0;
    sigaltstack(&ss, &old_ss);
    if (L->checked) {
        // zero-filled shadow means "no access recorded"; calloc'ed pages are only touched where
        // the kernel accesses shared memory
        __emu_t_dyn_shadow = (SShadow*)calloc(EMU_DYN_SMEM_MAX, sizeof(SShadow));
        size_t ns = (size_t)(g_static_hi_off - g_static_lo_off);
        __emu_t_stat_shadow = (SShadow*)calloc(ns ? ns : 1, sizeof(SShadow));
    }
    __emu_t_worker = w;
    if (sigsetjmp(w->jb, 1) == 0) {
        for (;;) {
            if (stopping(L)) break;
            long b = L->next_block.fetch_add(1);
            if (b >= L->nblocks) break;
            run_block(w, b);
        }
    }
    w->in_fiber = 0;
    w->cur = nullptr;
    __emu_t_worker = nullptr;
    sm90_worker_end(w);
    sigaltstack(&old_ss, nullptr);
    free(__emu_t_dyn_shadow);
    __emu_t_dyn_shadow = nullptr;
    free(__emu_t_stat_shadow);
    __emu_t_stat_shadow = nullptr;
    munmap(w->stacks, w->stacks_size);
}

// A launch runs on worker threads while the caller waits in short slices (__emu_launch_wait), so
// that Python runs its signal handlers meanwhile: a blocking call would hold off Ctrl-C until the
// last block. One launch per library at a time (Python holds the library's launch lock).
static Launch* g_launch = nullptr;

static void worker_main(Launch* L) {
    worker_run(L);
    std::lock_guard<std::mutex> g(L->run_mu);
    if (--L->running == 0) L->run_cv.notify_all();
}

EMU_EXPORT int __emu_launch_end(int cancel, EmuError* out);

EMU_EXPORT int __emu_launch_start(int k, const unsigned* grid, const unsigned* block, unsigned long long shmem,
                                  void** argv, int nranges, const unsigned long long* ranges, int checked,
                                  int schedule, unsigned long long seed, int nworkers) {
    if (g_launch) __emu_launch_end(1, nullptr);   // an abandoned launch must not outlive its arrays
    Launch* L = g_launch = new Launch();
    EmuError* err = L->err = &L->record;
    memset(err, 0, sizeof(*err));
    if (k < 0 || k >= __emu_kernel_count) { err->code = EMU_ERROR_GENERIC; snprintf(err->msg, sizeof(err->msg), "bad kernel index"); return err->code; }
    if (shmem > EMU_DYN_SMEM_MAX) {
        err->code = EMU_ERROR_GENERIC;
        snprintf(err->msg, sizeof(err->msg), "dynamic shared memory of %llu bytes exceeds the emulator's (and every GPU's) limit of %d bytes", shmem, EMU_DYN_SMEM_MAX);
        return err->code;
    }
    L->k = &__emu_kernel_table[k];
    L->argv = argv;
    for (int i = 0; i < 3; ++i) { L->grid[i] = grid[i]; L->block[i] = block[i]; }
    L->shmem = shmem;
    L->checked = checked;
    L->schedule = schedule;
    L->seed = seed;
    L->next_block = 0;
    L->nblocks = (long)grid[0] * grid[1] * grid[2];
    L->failed = 0;
    L->cancelled = 0;
    for (int i = 0; i < nranges; ++i)
        L->args.push_back({(uintptr_t)ranges[3 * i], (uintptr_t)(ranges[3 * i] + ranges[3 * i + 1]), (int)ranges[3 * i + 2]});
    if (checked) {
        // merge overlapping argument ranges into regions, each with a per-byte block shadow
        std::vector<Range> rs = L->args;
        std::sort(rs.begin(), rs.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
        for (auto& r : rs) {
            if (r.hi <= r.lo) continue;
            if (!L->regions.empty() && r.lo < L->regions.back().hi) { L->regions.back().hi = std::max(L->regions.back().hi, r.hi); continue; }
            L->regions.push_back({r.lo, r.hi, nullptr, nullptr, nullptr});
        }
        size_t total = 0;
        for (auto& g : L->regions) total += g.hi - g.lo;
        // intra-block race tracking on global memory costs 32 bytes of (lazily touched) shadow per
        // byte; skip it for very large launches (bounds and inter-block checks stay on)
        const bool intra = total <= ((size_t)512 << 20) / sizeof(SShadow);
        for (auto& g : L->regions) {
            g.wr = (int32_t*)calloc(g.hi - g.lo, sizeof(int32_t));
            g.rd = (int32_t*)calloc(g.hi - g.lo, sizeof(int32_t));
            if (intra) g.sh = (SShadow*)calloc(g.hi - g.lo, sizeof(SShadow));
        }
        nworkers = 1;
    }
    if (nworkers < 1) nworkers = 1;
    if (nworkers > L->nblocks) nworkers = (int)std::max(1L, L->nblocks);
    install_signals();
    L->handlers = true;
    L->running = nworkers;
    for (int i = 0; i < nworkers; ++i) {
        try {
            L->workers.emplace_back(worker_main, L);
        } catch (const std::system_error&) {   // out of threads: the ones started do the work
            std::lock_guard<std::mutex> g(L->run_mu);
            L->running -= nworkers - i;
            if (i == 0) { err->code = EMU_ERROR_GENERIC; snprintf(err->msg, sizeof(err->msg), "cannot start a worker thread"); }
            break;
        }
    }
    return err->code;
}

// 1 once every worker has finished (or none was started), 0 after `timeout_ms` otherwise.
EMU_EXPORT int __emu_launch_wait(int timeout_ms) {
    Launch* L = g_launch;
    if (!L) return 1;
    std::unique_lock<std::mutex> g(L->run_mu);
    return L->run_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [L] { return L->running == 0; });
}

// Checked mode's traffic of the launch so far: (argument index, bytes read, bytes written)
// of each array argument into out[3·i ..] (at most n of them); returns their count.
EMU_EXPORT int __emu_launch_traffic(uint64_t* out, int n) {
    Launch* L = g_launch;
    if (!L) return 0;
    for (int i = 0; i < (int)L->args.size() && i < n; ++i) {
        out[3 * i] = (uint64_t)L->args[i].arg;
        out[3 * i + 1] = L->args[i].read;
        out[3 * i + 2] = L->args[i].written;
    }
    return (int)L->args.size();
}

// Ends the launch: with `cancel`, the workers stop at their next fiber switch or block; waits for
// them, copies the error record to `out` and returns its code (no-op returning 0 without a launch).
EMU_EXPORT int __emu_launch_end(int cancel, EmuError* out) {
    Launch* L = g_launch;
    if (!L) return 0;
    if (cancel) L->cancelled.store(1);
    for (auto& t : L->workers) t.join();
    if (L->handlers) remove_signals();
    for (auto& g : L->regions) { free(g.wr); free(g.rd); free(g.sh); }
    fflush(stdout);
    int code = L->err->code;
    if (out) memcpy(out, L->err, sizeof(*out));
    g_launch = nullptr;
    delete L;
    return code;
}

// micro-benchmark of the context switch (ns per switch), used by the docs/tests
static void* bench_main_sp;
static void* bench_fiber_sp;
static long bench_iters;
extern "C" void __emu_bench_fiber() {
    for (long i = 0; i < bench_iters; ++i) {
#if defined(__x86_64__)
        __emu_ctx_switch(&bench_fiber_sp, bench_main_sp);
#endif
    }
    for (;;) {
#if defined(__x86_64__)
        __emu_ctx_switch(&bench_fiber_sp, bench_main_sp);
#endif
    }
}
EMU_EXPORT double __emu_bench_switch(long iters) {
#if defined(__x86_64__)
    static char stack[65536] __attribute__((aligned(16)));
    uint64_t* top = (uint64_t*)(stack + sizeof(stack));
    top[-1] = 0;
    top[-2] = (uint64_t)(uintptr_t)&__emu_bench_fiber;
    for (int r = 3; r <= 8; ++r) top[-r] = 0;
    uint32_t mx = 0x1F80; uint16_t cw = 0x037F; uint64_t ctl = 0;
    memcpy(&ctl, &mx, 4); memcpy((char*)&ctl + 4, &cw, 2);
    top[-9] = ctl;
    bench_fiber_sp = &top[-9];
    bench_iters = iters;
    uint64_t t0 = __emu_clock();
    for (long i = 0; i < iters; ++i) __emu_ctx_switch(&bench_main_sp, bench_fiber_sp);
    uint64_t t1 = __emu_clock();
    return (double)(t1 - t0) / (2.0 * iters);
#else
    (void)iters;
    return -1.0;
#endif
}
