// cuflash CPU emulator runtime: Hopper's asynchronous instructions (sm_90a), as the PTX ISA
// specifies them: wgmma, mbarriers, bulk copies (cp.async.bulk), named barriers, setmaxnreg,
// elect.sync, stmatrix; and checked mode's asynchronous hazards.
//
// Asynchronous work is done as late as the ISA allows, so that a kernel which forgets to wait
// reads what a GPU may give it (garbage), and checked mode names the culprit:
//  - wgmma.mma_async computes when its warpgroup meets, from the operands of that moment; each
//    thread's accumulators receive the result at the wgmma.wait_group that retires it;
//  - a bulk copy into shared memory reads its source at issue, fills its destination with NaN
//    bytes, and lands at the next arrival or expect_tx on its mbarrier, at a wait on it that
//    would otherwise block, or when nothing else can run;
//  - a bulk store reads shared memory at the issuing thread's cp.async.bulk.wait_group.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <algorithm>

#include "runtime.h"

static const int kSpinLimit = 100000;   // failed mbarrier.test_wait in a row before a deadlock is called

// Records the error; in a fiber, ends it (the scheduler, landing copies, just returns).
static void hazard(Worker* w, uintptr_t addr, int size, bool wr, void* pc, const char* fmt, ...) {
    EmuError* e = begin_error(w, EMU_ERROR_HAZARD);
    if (e) {
        e->addr = addr;
        e->size = size;
        e->is_write = wr;
        e->pc = rel_pc(pc);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    if (w->cur) abort_fiber(w);
}

static AsyncOp* new_op(Worker* w, int waiting, const char* what, const char* file, int line) {
    AsyncOp* op = new AsyncOp{waiting, what, file, line};
    w->sm90.ops.push_back(op);
    return op;
}

// ------------------------------------------------------------------------------------------
// block and fiber state, checked-mode hooks
void sm90_fiber_begin(Fiber* f) {
    Sm90Fiber& s = f->sm90;
    s.wg_regs.clear();
    s.wg_ops.clear();
    s.wg_groups = 0;
    s.wg_lo = UINTPTR_MAX;
    s.wg_hi = 0;
    s.proxy_fences = 0;
    s.stores.clear();
    s.bulk_groups = 0;
    s.spins = 0;
}

// The worker's async operations outlive their blocks (shared memory's shadow names them by
// index); a block that ended has completed them all.
void sm90_worker_end(Worker* w) {
    Sm90Block& b = w->sm90;
    for (AsyncOp* op : b.ops) delete op;
    for (BulkCopy* c : b.copies) delete c;
    b.ops.clear();
    b.copies.clear();
    b.mbar.clear();
}

void sm90_block_begin(Worker* w) {
    Sm90Block& b = w->sm90;
    for (AsyncOp* op : b.ops) op->waiting = 0;
    for (BulkCopy* c : b.copies) {
        c->landed = true;
        std::vector<char>().swap(c->data);
    }
    b.mbar.clear();
    const int groups = (w->nthreads + 127) / 128;
    // setmaxnreg: every warpgroup starts with the registers the launch can give each thread
    const int regs = std::min(255, 65536 / std::max(1, w->nthreads)) & ~7;
    for (int g = 0; g < 8; ++g) {
        b.wg_arrived[g] = 0;
        b.regs[g] = g < groups ? regs : 0;
        b.reg_count[g] = 0;
    }
    for (NamedBarrier& n : b.named) n = NamedBarrier{0, 0, nullptr, 0};
}

// An access by the current fiber of its own memory (a register variable) that a wgmma in flight owns.
void sm90_guard(Worker* w, Fiber* f, uintptr_t a, int size, bool wr, void* pc) {
    for (const WgReg& r : f->sm90.wg_regs) {
        const uintptr_t lo = (uintptr_t)r.addr;
        if (a < lo + 4 && lo < a + size)
            hazard(w, a, size, wr, pc, "the wgmma.mma_async at %s:%d still owns this register (%s); touch it only "
                   "after the wgmma.wait_group that retires the wgmma", r.op->file, r.op->line,
                   r.accumulator ? "an accumulator: its result lands at the wait" : "an A operand");
    }
}

// A thread's access of one shared byte that an asynchronous operation reads (async_rd) or writes (bulk_wr).
void sm90_shared_access(Worker* w, SShadow& s, uintptr_t a, int size, bool wr, void* pc) {
    if (s.bulk_wr) {
        const BulkCopy* c = w->sm90.copies[s.bulk_wr - 1];
        if (!c->landed)
            hazard(w, a, size, wr, pc, "the %s at %s:%d still writes this shared memory: it lands when the phase of "
                   "its mbarrier completes (wait for it with mbarrier.try_wait first)", c->what, c->file, c->line);
        s.bulk_wr = 0;
    }
    if (s.async_rd && wr) {
        const AsyncOp* op = w->sm90.ops[s.async_rd - 1];
        if (op->waiting > 0)
            hazard(w, a, size, wr, pc, "the %s at %s:%d still reads this shared memory: wait for it first (%s)", op->what,
                   op->file, op->line, strcmp(op->what, "wgmma.mma_async") == 0
                   ? "every thread of its warpgroup retires it with wgmma.wait_group"
                   : "its thread's cp.async.bulk.wait_group.read");
        s.async_rd = 0;
    }
}

// A generic write by `writer` (in the current barrier epoch) is ordered before an operation that
// `issuer` starts: its own write, or one by its warp before a __syncwarp. A wgmma (issuer -1) is
// started by four warps, each of which may read any of its operands: every write needs a barrier.
static bool ordered_before(const Worker* w, int issuer, int writer, uint32_t wsync) {
    return issuer >= 0 && (writer == issuer || ((writer >> 5) == (issuer >> 5) && w->warp_sync[issuer >> 5] > wsync));
}

// A hazard report naming the last generic write of the shared byte at `addr` (shadow s): its
// thread and line; the caller adds the message (when the report is taken) and aborts.
static EmuError* write_hazard(Worker* w, const SShadow& s, uintptr_t addr) {
    EmuError* e = begin_error(w, EMU_ERROR_HAZARD);
    if (e) {
        const Fiber& o = w->fibers[s.w_tid];
        e->addr = addr;
        e->pc = s.w_pc;
        e->size = 1;
        e->is_write = 1;
        e->thread[0] = o.tid.x; e->thread[1] = o.tid.y; e->thread[2] = o.tid.z;
    }
    return e;
}

// The async proxy reads `size` shared bytes at p for `op` (checked mode), issued by thread `issuer`
// (-1: a warpgroup): a generic write of them must be followed by its thread's fence.proxy.async and
// ordered before the issue by a barrier (bar.sync, a named barrier, an mbarrier phase) where another
// thread wrote it, and no bulk copy may still be writing them.
static void async_read(Worker* w, uintptr_t p, int size, const AsyncOp* op, uint32_t reader, int issuer) {
    int space;
    int64_t off;
    SShadow* sh = shared_shadow(w, p, &space, &off);
    for (int b = 0; b < size; ++b) {
        SShadow& s = sh[b];
        if (s.bulk_wr && !w->sm90.copies[s.bulk_wr - 1]->landed) {
            const BulkCopy* c = w->sm90.copies[s.bulk_wr - 1];
            hazard(w, p + b, 1, false, nullptr, "the %s at %s:%d reads shared memory that the %s at %s:%d has not "
                   "landed yet: wait on its mbarrier first", op->what, op->file, op->line, c->what, c->file, c->line);
        }
        if (s.w_tid >= 0 && s.w_epoch >= w->block_epoch && s.w_epoch != 0 &&
            w->fibers[s.w_tid].sm90.proxy_fences == s.w_fence) {
            if (EmuError* e = write_hazard(w, s, p + b))
                emsg(e, "this generic-proxy write of shared memory is read by the async proxy (%s at %s:%d) with "
                        "no fence.proxy.async by the writing thread in between", op->what, op->file, op->line);
            abort_fiber(w);
        }
        if (s.w_tid >= 0 && s.w_epoch == w->epoch && !ordered_before(w, issuer, s.w_tid, s.w_wsync)) {
            if (EmuError* e = write_hazard(w, s, p + b))
                emsg(e, "this write of shared memory is read by the %s at %s:%d with no barrier between them: the "
                        "threads that write an asynchronous operation's operand meet its issuers on a barrier "
                        "(bar.sync, a named barrier or an mbarrier phase) after their fence.proxy.async",
                     op->what, op->file, op->line);
            abort_fiber(w);
        }
        if (reader) s.async_rd = reader;
    }
}

// The async proxy is about to write [p, p + size) (checked mode): no operation in flight may read it.
static void async_write(Worker* w, uintptr_t p, int size, uint32_t writer, const char* what, const char* file, int line) {
    int space;
    int64_t off;
    SShadow* sh = shared_shadow(w, p, &space, &off);
    for (int b = 0; b < size; ++b) {
        SShadow& s = sh[b];
        if (s.async_rd && w->sm90.ops[s.async_rd - 1]->waiting > 0) {
            const AsyncOp* op = w->sm90.ops[s.async_rd - 1];
            hazard(w, p + b, 1, true, nullptr, "the %s at %s:%d overwrites shared memory that the %s at %s:%d still "
                   "reads", what, file, line, op->what, op->file, op->line);
        }
        // a thread's access of these bytes must be ordered before the copy (a barrier or an mbarrier phase)
        const bool read = s.r_tid >= 0 && s.r_epoch == w->epoch, written = s.w_tid >= 0 && s.w_epoch == w->epoch;
        if (read || written) {
            const Fiber& o = w->fibers[read ? s.r_tid : s.w_tid];
            EmuError* e = begin_error(w, EMU_ERROR_HAZARD);
            if (e) {
                e->addr = p + b;
                e->pc = read ? s.r_pc : s.w_pc;
                e->size = 1;
                e->is_write = !read;
                e->thread[0] = o.tid.x; e->thread[1] = o.tid.y; e->thread[2] = o.tid.z;
                emsg(e, "the %s at %s:%d overwrites this shared memory with nothing ordering the two (the thread "
                        "must be done with it before the copy is issued: a barrier, or an mbarrier phase the issuing "
                        "thread waits for)", what, file, line);
            }
            abort_fiber(w);
        }
        s.async_rd = 0;
        s.bulk_wr = writer;
        s.w_tid = -1;   // written by the async proxy, not a thread
        s.r_tid = -1;
    }
}

// ------------------------------------------------------------------------------------------
// wgmma: the 128 threads of a warpgroup meet at wgmma.mma_async
struct WgmmaCall {
    int n, k, type, scale_d, neg_a, neg_b, trans_a, trans_b;
    uint64_t desc_a, desc_b;
    uint32_t a[4];
    const void* a_lv[4];
    bool a_regs;
    uint32_t* const* d;
    EmuMmaArith arith;
};

// The index of the register at `addr` among the first `limit` in flight (-1: none); a wgmma's
// accumulators follow each other, so `hint` (the previous one's index + 1) usually hits.
static int wg_find(const Sm90Fiber& f, const uint32_t* addr, size_t hint, size_t limit) {
    if (hint < limit && f.wg_regs[hint].addr == addr) return (int)hint;
    for (size_t i = 0; i < limit; ++i)
        if (f.wg_regs[i].addr == addr) return (int)i;
    return -1;
}

// Registers the wgmma `op` owns from now on; `limit`: how many were in flight before it (the
// accumulators of earlier wgmmas it may accumulate into).
static void wg_own(Sm90Fiber& f, uint32_t* addr, uint32_t value, AsyncOp* op, bool accumulator, size_t hint,
                   size_t limit) {
    const int i = accumulator ? wg_find(f, addr, hint, limit) : -1;
    if (i >= 0) {
        f.wg_regs[i] = {addr, value, -1, op, true};   // a later wgmma accumulating into the same register
    } else {
        f.wg_regs.push_back({addr, value, -1, op, accumulator});
        f.wg_lo = std::min(f.wg_lo, (uintptr_t)addr);
        f.wg_hi = std::max(f.wg_hi, (uintptr_t)addr + 4);
    }
}

static EmuWgmmaDesc wg_desc(Worker* w, uint64_t desc, const char* which, const AsyncOp* op) {
    const EmuWgmmaDesc d = emu_wgmma_desc(desc);
    if (d.base_offset && d.swizzle)
        ptx_fail(w, EMU_ERROR_GENERIC, "wgmma.mma_async at %s:%d: the %s descriptor has base offset %d; the emulator "
                 "runs only base offset 0 (swizzle atoms aligned to their pattern: 256, 512 or 1024 bytes)", op->file,
                 op->line, which, d.base_offset);
    return d;
}

// The elements (mn, k) of an operand from shared memory, through its descriptor, into
// out[mn * mn_stride + k * k_stride]; the region of shared memory the last element lay in
// bounds-checks the next with two compares.
static void wg_gather(Worker* w, AsyncOp* op, uint64_t desc, bool k_major, int elem, int rows, int k, uint32_t* out,
                      int mn_stride, int k_stride, const char* which) {
    const EmuWgmmaDesc d = wg_desc(w, desc, which, op);
    const uintptr_t tb = tls_base();
    const bool checked = w->L->checked;
    uintptr_t lo = 0, hi = 0;
    for (int mn = 0; mn < rows; ++mn)
        for (int kk = 0; kk < k; ++kk) {
            const uint32_t a = emu_wgmma_address(d, k_major, elem, mn, kk);
            const uintptr_t p = tb + a;
            if ((p < lo || p + elem > hi) && !shared_region(w, p, elem, &lo, &hi))
                ptx_fail(w, EMU_ERROR_BOUNDS, "wgmma.mma_async at %s:%d: element (%d, %d) of %s lies at shared address "
                         "0x%x, outside every __shared__ variable and the launch's %llu bytes of dynamic shared memory "
                         "(check the descriptor's start address, LBO, SBO and swizzle)", op->file, op->line, mn, kk,
                         which, a, w->L->shmem);
            uint32_t v = 0;
            memcpy(&v, (const void*)p, elem);
            out[mn * mn_stride + kk * k_stride] = v;
            if (checked) async_read(w, p, elem, op, (uint32_t)w->sm90.ops.size(), -1);
        }
}

static void wg_compute(Worker* w, int wg) {
    Fiber* base = &w->fibers[wg * 128];
    const WgmmaCall& c = *(const WgmmaCall*)base[0].gsrc;
    for (int t = 1; t < 128; ++t) {
        const Fiber& f = base[t];
        const WgmmaCall& o = *(const WgmmaCall*)f.gsrc;
        const char* what = f.wpc != base[0].wpc ? "another instruction"
                         : o.desc_a != c.desc_a || o.desc_b != c.desc_b ? "other descriptors"
                         : o.scale_d != c.scale_d ? "another scale-d" : nullptr;
        if (what) {
            EmuError* e = begin_error(w, EMU_ERROR_DEADLOCK);
            if (e) {
                emsg(e, "block (%u,%u,%u), warpgroup %d: wgmma.mma_async at %s:%d is .sync.aligned over the warpgroup, "
                        "so its 128 threads must execute it together with the same operands, but thread %d gives %s",
                     w->block.x, w->block.y, w->block.z, wg, base[0].wfile, base[0].wline, wg * 128 + t, what);
                e->pc = rel_pc(base[0].wpc);
                e->other_pc = rel_pc(f.wpc);
                e->thread[0] = base[0].tid.x; e->thread[1] = base[0].tid.y; e->thread[2] = base[0].tid.z;
                e->other_thread[0] = f.tid.x; e->other_thread[1] = f.tid.y; e->other_thread[2] = f.tid.z;
            }
            return;
        }
    }
    AsyncOp* op = new_op(w, 128, "wgmma.mma_async", base[0].wfile, base[0].wline);
    const int n = c.n, k = c.k, elem = c.type == EMU_MMA_TF32 ? 4 : 2;
    const uint32_t sign = c.type == EMU_MMA_TF32 ? 0x80000000u : 0x8000u;
    static thread_local std::vector<uint32_t> __emu_a, __emu_b, __emu_c, __emu_d;   // "__emu_": not __shared__
    std::vector<uint32_t>&A = __emu_a, &B = __emu_b, &C = __emu_c, &D = __emu_d;
    A.assign(64 * k, 0);
    B.assign(k * n, 0);
    C.assign(64 * n, 0);
    D.assign(64 * n, 0);
    // A: from the warpgroup's registers (warp w holds rows 16w..16w+15 as mma.sync's A) or shared memory
    if (c.a_regs) {
        for (int t = 0; t < 128; ++t) {
            const WgmmaCall& o = *(const WgmmaCall*)base[t].gsrc;
            const int r0 = 16 * (t >> 5), g = (t & 31) >> 2, q = t & 3;
            for (int i = 0; i < 4; ++i) {
                const uint32_t v = o.a_lv[i] ? *(const uint32_t*)o.a_lv[i] : o.a[i];
                if (c.type == EMU_MMA_TF32) {   // a_i: row g (+8 for odd i), k q (+4 for i >= 2)
                    A[(r0 + g + 8 * (i & 1)) * k + q + 4 * (i >> 1)] = v;
                } else {                        // a_i holds k 2q, 2q+1 (+8 for i >= 2) of row g (+8 for odd i)
                    const int row = r0 + g + 8 * (i & 1), col = 2 * q + 8 * (i >> 1);
                    A[row * k + col] = v & 0xffff;
                    A[row * k + col + 1] = v >> 16;
                }
            }
        }
    } else {
        wg_gather(w, op, c.desc_a, !c.trans_a, elem, 64, k, A.data(), k, 1, "A");
    }
    wg_gather(w, op, c.desc_b, !c.trans_b, elem, n, k, B.data(), 1, n, "B");
    if (c.neg_a) for (uint32_t& v : A) v ^= sign;
    if (c.neg_b) for (uint32_t& v : B) v ^= sign;
    // C: each thread's accumulators as its registers hold them, or as an earlier wgmma in flight leaves them
    // (accumulator i of a thread: row 16w + g (+8 for i % 4 >= 2), column 8 (i / 4) + 2q + i % 2)
    size_t limit[128];   // per thread: its registers in flight before this wgmma that may be its accumulators
    for (int t = 0; t < 128; ++t) {
        const Sm90Fiber& f = base[t].sm90;
        uint32_t* const* d = ((const WgmmaCall*)base[t].gsrc)->d;
        uintptr_t lo = UINTPTR_MAX, hi = 0;
        for (int i = 0; i < n / 2; ++i) {
            lo = std::min(lo, (uintptr_t)d[i]);
            hi = std::max(hi, (uintptr_t)d[i] + 4);
        }
        limit[t] = lo < f.wg_hi && f.wg_lo < hi ? f.wg_regs.size() : 0;
    }
    for (int t = 0; t < 128 && c.scale_d; ++t) {
        const Fiber& f = base[t];
        uint32_t* const* d = ((const WgmmaCall*)f.gsrc)->d;
        const int r0 = 16 * (t >> 5) + ((t & 31) >> 2), c0 = 2 * (t & 3);
        const int first = wg_find(f.sm90, d[0], 0, limit[t]);
        for (int i = 0; i < n / 2; ++i) {
            const int j = limit[t] ? wg_find(f.sm90, d[i], first >= 0 ? (size_t)(first + i) : 0, limit[t]) : -1;
            C[(r0 + 8 * ((i >> 1) & 1)) * n + 8 * (i >> 2) + c0 + (i & 1)] = j >= 0 ? f.sm90.wg_regs[j].value : *d[i];
        }
    }
    emu_wgmma(n, k, c.type, c.arith, A.data(), B.data(), C.data(), D.data());
    for (int t = 0; t < 128; ++t) {
        Fiber& f = base[t];
        const WgmmaCall& o = *(const WgmmaCall*)f.gsrc;
        const int r0 = 16 * (t >> 5) + ((t & 31) >> 2), c0 = 2 * (t & 3);
        const int first = wg_find(f.sm90, o.d[0], 0, limit[t]);
        for (int i = 0; i < n / 2; ++i)
            wg_own(f.sm90, o.d[i], D[(r0 + 8 * ((i >> 1) & 1)) * n + 8 * (i >> 2) + c0 + (i & 1)], op, true,
                   first >= 0 ? (size_t)(first + i) : 0, limit[t]);
        if (w->L->checked && c.a_regs)
            for (int i = 0; i < 4; ++i)
                if (o.a_lv[i]) wg_own(f.sm90, (uint32_t*)o.a_lv[i], 0, op, false, 0, 0);
        f.sm90.wg_ops.push_back({op, -1});
        f.state = F_RUNNABLE;
    }
    w->sm90.wg_arrived[wg] = 0;
}

EMU_EXPORT void __emu_ptx_wgmma(int n, int k, int type, uint64_t desc_a, const uint32_t* a, const void* const* a_lv,
                                uint64_t desc_b, int scale_d, int scale_a, int scale_b, int trans_a, int trans_b,
                                uint32_t* const* d, int block_k, int extra_bits, int min_exponent, const char* file,
                                int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1) || (trans_a & ~1) || (trans_b & ~1))
        ptx_fail(w, EMU_ERROR_GENERIC, "wgmma.mma_async at %s:%d: imm-scale-a/b must be 1 or -1 and imm-trans-a/b 0 "
                 "or 1, got %d, %d, %d, %d", file, line, scale_a, scale_b, trans_a, trans_b);
    const int wg = f->linear >> 7;
    if ((wg + 1) * 128 > w->nthreads)
        ptx_fail(w, EMU_ERROR_GENERIC, "wgmma.mma_async at %s:%d: warpgroup %d of the block has only %d thread(s); "
                 "the instruction needs all 128 (make the block size a multiple of 128)", file, line, wg,
                 w->nthreads - wg * 128);
    WgmmaCall call{n, k, type, scale_d, scale_a < 0, scale_b < 0, trans_a, trans_b, desc_a, desc_b, {}, {},
                   a != nullptr, d, {block_k, extra_bits, min_exponent}};
    if (a) {
        memcpy(call.a, a, sizeof(call.a));
        memcpy(call.a_lv, a_lv, sizeof(call.a_lv));
    }
    f->gsrc = &call;
    f->wpc = __builtin_return_address(0);
    f->op = EMU_WG_MMA;
    f->wfile = file;
    f->wline = line;
    f->state = F_WAIT_WG;
    if (++w->sm90.wg_arrived[wg] == 128) wg_compute(w, wg);
    switch_to_sched(w);
}

EMU_EXPORT void __emu_ptx_wgmma_commit(const char*, int) {
    Sm90Fiber& f = __emu_t_worker->cur->sm90;
    for (WgReg& r : f.wg_regs)
        if (r.group < 0) r.group = f.wg_groups;
    for (auto& o : f.wg_ops)
        if (o.second < 0) o.second = f.wg_groups;
    f.wg_groups++;
}

// wgmma.wait_group n: every committed group but the n newest retires; its results land.
EMU_EXPORT void __emu_ptx_wgmma_wait(int n, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Sm90Fiber& f = w->cur->sm90;
    if (n < 0 || n > 7) ptx_fail(w, EMU_ERROR_GENERIC, "wgmma.wait_group at %s:%d: N = %d is not in 0..7", file, line, n);
    const int done = f.wg_groups - n;
    size_t keep = 0;
    for (const WgReg& r : f.wg_regs) {
        if (r.group >= 0 && r.group < done) {
            if (r.accumulator) memcpy(r.addr, &r.value, 4);
        } else {
            f.wg_regs[keep++] = r;
        }
    }
    f.wg_regs.resize(keep);
    if (keep == 0) { f.wg_lo = UINTPTR_MAX; f.wg_hi = 0; }
    keep = 0;
    for (const auto& o : f.wg_ops) {
        if (o.second >= 0 && o.second < done) o.first->waiting--;
        else f.wg_ops[keep++] = o;
    }
    f.wg_ops.resize(keep);
}

// fence.proxy.async: the thread's earlier generic-proxy accesses are ordered before its later
// async-proxy ones
EMU_EXPORT void __emu_ptx_fence_proxy_async(void) { __emu_t_worker->cur->sm90.proxy_fences++; }

// ------------------------------------------------------------------------------------------
// mbarrier
static uint32_t shared_addr(Worker* w, uint64_t addr, int generic, int size, const char* what, const char* file,
                            int line) {
    const uintptr_t p = shared_ptr(w, addr, generic, size);
    if (!p || addr % (size >= 16 ? 16 : size))
        ptx_fail(w, EMU_ERROR_BOUNDS, "%s at %s:%d: %s address 0x%llx is not %d bytes of shared memory aligned to %d "
                 "(inside a __shared__ variable or the launch's %llu bytes of dynamic shared memory)", what, file, line,
                 generic ? "generic" : "shared", (unsigned long long)addr, size, size >= 16 ? 16 : size, w->L->shmem);
    return (uint32_t)(p - tls_base());
}

// The mbarrier at `addr`; its shared address in *shared.
static MBarrier& mbar_at(Worker* w, uint64_t addr, int generic, const char* what, const char* file, int line,
                         uint32_t* shared = nullptr) {
    const uint32_t a = shared_addr(w, addr, generic, 8, what, file, line);
    if (shared) *shared = a;
    auto it = w->sm90.mbar.find(a);
    if (it == w->sm90.mbar.end() || !it->second.valid)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: shared address 0x%x holds no initialised mbarrier "
                 "(mbarrier.init it first%s)", what, file, line, a,
                 it == w->sm90.mbar.end() ? "" : "; it was invalidated with mbarrier.inval");
    return it->second;
}

static bool phase_done(const MBarrier& m, uint64_t phase, bool parity) {
    return parity ? (m.phase & 1) != (phase & 1) : m.phase != phase;
}

// A phase completes when no arrival and no transaction byte is pending.
static void mbar_check(Worker* w, uint32_t a, MBarrier& m) {
    if (m.pending != 0 || m.tx != 0) return;
    m.phase++;
    m.pending = m.expected;
    new_epoch(w);   // the phase orders the arrivals before it with the waits after it
    for (Fiber& f : w->fibers)
        if (f.state == F_WAIT_MBAR && f.sm90.wait_mbar == a && phase_done(m, f.sm90.wait_phase, f.sm90.wait_parity))
            f.state = F_RUNNABLE;
}

// The copies in flight on the barrier land now (someone waits, or nothing else can run).
static bool mbar_land(Worker* w, uint32_t a, MBarrier& m) {
    if (m.copies.empty()) return false;
    int64_t bytes = 0;
    for (BulkCopy* c : m.copies) {
        memcpy(c->dst, c->data.data(), c->data.size());
        c->landed = true;
        bytes += (int64_t)c->data.size();
        std::vector<char>().swap(c->data);   // landed: the staging bytes go
    }
    BulkCopy* last = m.copies.back();
    m.copies.clear();
    m.tx -= bytes;
    if (m.tx < 0) {
        hazard(w, 0, 0, false, nullptr, "the mbarrier initialised at %s:%d (shared address 0x%x) received %lld more "
               "transaction bytes in phase %llu than expect_tx announced (the last copy: %s at %s:%d): its phase "
               "would complete before every copy landed", m.file, m.line, a, (long long)-m.tx,
               (unsigned long long)m.phase, last->what, last->file, last->line);
        return false;
    }
    mbar_check(w, a, m);
    return true;
}

EMU_EXPORT void __emu_ptx_mbar_init(uint64_t addr, int generic, int count, const char* file, int line) {
    Worker* w = __emu_t_worker;
    const uint32_t a = shared_addr(w, addr, generic, 8, "mbarrier.init", file, line);
    if (count < 1 || count > (1 << 20) - 1)
        ptx_fail(w, EMU_ERROR_GENERIC, "mbarrier.init at %s:%d: count %d is not in 1..2^20-1", file, line, count);
    MBarrier& m = w->sm90.mbar[a];
    if (m.valid)
        ptx_fail(w, EMU_ERROR_GENERIC, "mbarrier.init at %s:%d: shared address 0x%x already holds the mbarrier "
                 "initialised at %s:%d (mbarrier.inval it before reusing the memory)", file, line, a, m.file, m.line);
    m = MBarrier{true, 0, count, count, 0, file, line, {}};
}

EMU_EXPORT void __emu_ptx_mbar_inval(uint64_t addr, int generic, const char* file, int line) {
    Worker* w = __emu_t_worker;
    MBarrier& m = mbar_at(w, addr, generic, "mbarrier.inval", file, line);
    if (!m.copies.empty())
        hazard(w, 0, 0, false, nullptr, "mbarrier.inval at %s:%d: the %s at %s:%d still completes transactions on it",
               file, line, m.copies[0]->what, m.copies[0]->file, m.copies[0]->line);
    m.valid = false;
}

// arrive-on (count arrivals) after expect-tx(tx); returns the state: the phase arrived on
EMU_EXPORT uint64_t __emu_ptx_mbar_arrive(uint64_t addr, int generic, int count, int64_t tx, const char* file, int line) {
    Worker* w = __emu_t_worker;
    uint32_t a;
    MBarrier& m = mbar_at(w, addr, generic, "mbarrier.arrive", file, line, &a);
    mbar_land(w, a, m);   // time has passed since the copies were issued
    const uint64_t state = m.phase;
    if (count < 1)
        ptx_fail(w, EMU_ERROR_GENERIC, "mbarrier.arrive at %s:%d: count %d is not positive", file, line, count);
    m.tx += tx;
    m.pending -= count;
    if (m.pending < 0)
        hazard(w, 0, 0, false, nullptr, "mbarrier.arrive at %s:%d: more arrivals than the expected count %d of the "
               "mbarrier initialised at %s:%d in its phase %llu", file, line, m.expected, m.file, m.line,
               (unsigned long long)m.phase);
    mbar_check(w, a, m);
    return state;
}

// expect-tx(tx), or complete-tx(tx) with `complete`
EMU_EXPORT void __emu_ptx_mbar_tx(uint64_t addr, int generic, int64_t tx, int complete, const char* file, int line) {
    Worker* w = __emu_t_worker;
    const char* what = complete ? "mbarrier.complete_tx" : "mbarrier.expect_tx";
    uint32_t a;
    MBarrier& m = mbar_at(w, addr, generic, what, file, line, &a);
    mbar_land(w, a, m);
    m.tx += complete ? -tx : tx;
    if (complete) mbar_check(w, a, m);
}

// try_wait (blocking: returns once the phase completed) or test_wait; `parity`: `phase` is a parity
EMU_EXPORT int __emu_ptx_mbar_wait(uint64_t addr, int generic, uint64_t phase, int parity, int blocking,
                                   const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    const char* what = blocking ? "mbarrier.try_wait" : "mbarrier.test_wait";
    uint32_t a;
    MBarrier& m = mbar_at(w, addr, generic, what, file, line, &a);
    if (!parity && phase != m.phase && phase + 1 != m.phase)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: the state names phase %llu but the mbarrier is in phase %llu "
                 "(a state is valid for the current phase and the one before)", what, file, line,
                 (unsigned long long)phase, (unsigned long long)m.phase);
    // a wait that is not over lets the copies in flight land
    if (!phase_done(m, phase, parity)) mbar_land(w, a, m);
    if (phase_done(m, phase, parity)) {
        f->sm90.spins = 0;
        return 1;
    }
    f->wfile = file;
    f->wline = line;
    if (!blocking) {
        if (++f->sm90.spins > kSpinLimit) {
            EmuError* e = begin_error(w, EMU_ERROR_DEADLOCK);
            if (e)
                emsg(e, "block (%u,%u,%u): mbarrier.test_wait at %s:%d failed %d times in a row on the mbarrier "
                        "initialised at %s:%d (phase %llu, %d of %d arrivals pending, tx-count %lld): it never completes",
                     w->block.x, w->block.y, w->block.z, file, line, kSpinLimit, m.file, m.line,
                     (unsigned long long)m.phase, m.pending, m.expected, (long long)m.tx);
            abort_fiber(w);
        }
        switch_to_sched(w);   // let the others run before the next poll
        return 0;
    }
    f->state = F_WAIT_MBAR;
    f->sm90.wait_mbar = a;
    f->sm90.wait_phase = phase;
    f->sm90.wait_parity = parity;
    switch_to_sched(w);
    return 1;
}

// cp.async.mbarrier.arrive: an arrive-on once the thread's cp.async complete (they complete now);
// without .noinc the pending count is raised first, so the arrival does not count in the phase
extern "C" void __emu_ptx_cp_async_commit(void);
extern "C" void __emu_ptx_cp_async_wait(int n, const char* file, int line);
EMU_EXPORT void __emu_ptx_cp_async_mbar_arrive(uint64_t addr, int generic, int noinc, const char* file, int line) {
    Worker* w = __emu_t_worker;
    mbar_at(w, addr, generic, "cp.async.mbarrier.arrive", file, line);
    __emu_ptx_cp_async_commit();
    __emu_ptx_cp_async_wait(0, file, line);
    if (noinc) __emu_ptx_mbar_arrive(addr, generic, 1, 0, file, line);
}

// ------------------------------------------------------------------------------------------
// bulk copies
static BulkCopy* bulk_copy(Worker* w, char* dst, size_t size, const char* what, const char* file, int line) {
    BulkCopy* c = new BulkCopy{dst, std::vector<char>(size), false, what, file, line};
    w->sm90.copies.push_back(c);
    if (w->L->checked) async_write(w, (uintptr_t)dst, (int)size, (uint32_t)w->sm90.copies.size(), what, file, line);
    return c;
}

// cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [dst], [src], size, [mbar]
EMU_EXPORT void __emu_ptx_bulk_load(uint64_t dst, uint64_t src, uint32_t size, uint64_t mbar, const char* file,
                                    int line) {
    Worker* w = __emu_t_worker;
    const char* what = "cp.async.bulk";
    if (size == 0 || size % 16 || src % 16)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: size %u must be a positive multiple of 16 and the global source "
                 "0x%llx 16-byte aligned", what, file, line, size, (unsigned long long)src);
    char* d = (char*)(tls_base() + shared_addr(w, dst, 0, (int)size, what, file, line));
    MBarrier& m = mbar_at(w, mbar, 0, what, file, line);
    if (w->L->checked) check_access((uintptr_t)src, (int)size, false, __builtin_return_address(0));
    BulkCopy* c = bulk_copy(w, d, size, what, file, line);
    memcpy(c->data.data(), (const void*)(uintptr_t)src, size);
    memset(d, 0xff, size);   // NaN until it lands
    m.copies.push_back(c);
}

static void bulk_store(Worker* w, char* dst, const char* src, size_t size,
                       std::vector<std::pair<int64_t, int64_t>> map, int elem,
                       void* pc, const char* what, const char* file, int line) {
    Sm90Fiber& f = w->cur->sm90;
    if (w->L->checked && elem <= 0)   // the thread's own stores and adds still on their way to memory
        for (const BulkStore& o : f.stores)
            if (o.elem <= 0 && o.dst < dst + size && dst < o.dst + o.size)
                hazard(w, (uintptr_t)dst, (int)size, true, pc, "the %s at %s:%d writes these global bytes too and has "
                       "not completed: which lands last (for adds, their order and so the sum's last bits) is not "
                       "defined; wait for it with cp.async.bulk.wait_group without .read first", o.op->what,
                       o.op->file, o.op->line);
    AsyncOp* op = new_op(w, 1, what, file, line);
    if (w->L->checked) async_read(w, (uintptr_t)src, (int)size, op, (uint32_t)w->sm90.ops.size(), w->cur->linear);
    f.stores.push_back({dst, src, size, std::move(map), elem, -1, op, (uint32_t)rel_pc(pc), {}});
}

// A store from shared memory to global memory that lands at its thread's wait without .read,
// or its exit (elem 0: copied, -1: its floats added), from the address of the kernel's call `pc`
static void bulk_store_from(uint64_t dst, uint64_t src, uint32_t size, int elem, void* pc, const char* what,
                            const char* file, int line) {
    Worker* w = __emu_t_worker;
    if (size == 0 || size % 16 || dst % 16)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: size %u must be a positive multiple of 16 and the global "
                 "destination 0x%llx 16-byte aligned", what, file, line, size, (unsigned long long)dst);
    const char* s = (const char*)(tls_base() + shared_addr(w, src, 0, (int)size, what, file, line));
    bulk_store(w, (char*)(uintptr_t)dst, s, size, {}, elem, pc, what, file, line);
}

// cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size
EMU_EXPORT void __emu_ptx_bulk_store(uint64_t dst, uint64_t src, uint32_t size, const char* file, int line) {
    bulk_store_from(dst, src, size, 0, __builtin_return_address(0), "cp.async.bulk (store)", file, line);
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], size: the floats land
// as atomic adds (other blocks may add to the same ones) when the group completes
EMU_EXPORT void __emu_ptx_bulk_reduce_add_f32(uint64_t dst, uint64_t src, uint32_t size, const char* file,
                                              int line) {
    bulk_store_from(dst, src, size, -1, __builtin_return_address(0), "cp.reduce.async.bulk", file, line);
}

static void add_floats(char* dst, const char* src, size_t size) {
    for (size_t i = 0; i < size; i += 4) {
        uint32_t* p = reinterpret_cast<uint32_t*>(dst + i);
        float v;
        memcpy(&v, src + i, 4);
        uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
        for (;;) {
            float o;
            memcpy(&o, &old, 4);
            const float n = o + v;
            uint32_t nu;
            memcpy(&nu, &n, 4);
            if (__atomic_compare_exchange_n(p, &old, nu, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) break;
        }
    }
}

EMU_EXPORT void __emu_ptx_bulk_commit(void) {
    Sm90Fiber& f = __emu_t_worker->cur->sm90;
    for (BulkStore& s : f.stores)
        if (s.group < 0) s.group = f.bulk_groups;
    f.bulk_groups++;
}

// The source bytes a store reads: a plain store's or reduce-add's size, a tensor store's elements.
static size_t source_span(const BulkStore& s) {
    if (s.elem <= 0) return s.size;
    int64_t end = 0;
    for (const auto& e : s.map) end = std::max(end, e.second + s.elem);
    return (size_t)end;
}

// Writes a store's destination (from its source, or the copy a .read wait made of it).
static void land(Worker* w, BulkStore& s) {
    if (s.elem == 0) {   // a plain bulk store
        if (w->L->checked) check_access((uintptr_t)s.dst, (int)s.size, true, (void*)(g_module_base + s.pc));
        memcpy(s.dst, s.src, s.size);
    } else if (s.elem < 0) {   // a bulk reduce-add: atomics
        if (w->L->checked)
            check_access((uintptr_t)s.dst, (int)s.size, true, (void*)(g_module_base + s.pc), true);
        add_floats(s.dst, s.src, s.size);
    } else {   // a tensor store: the elements in bounds (none for a box wholly outside)
        for (const auto& e : s.map) {
            if (w->L->checked) check_access((uintptr_t)(s.dst + e.first), s.elem, true, (void*)(g_module_base + s.pc));
            memcpy(s.dst + e.first, s.src + e.second, s.elem);
        }
    }
    s.op->waiting = 0;
}

// cp.async.bulk.wait_group{.read} n: the stores of every committed group but the n newest have
// read their shared memory (.read: copied here, their writes still to come) or are done
EMU_EXPORT void __emu_ptx_bulk_wait(int n, int read, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Sm90Fiber& f = w->cur->sm90;
    if (n < 0) ptx_fail(w, EMU_ERROR_GENERIC, "cp.async.bulk.wait_group at %s:%d: N = %d is negative", file, line, n);
    const int done = f.bulk_groups - n;
    size_t keep = 0;
    for (BulkStore& s : f.stores) {
        if (s.group >= 0 && s.group < done && read && s.data.empty()) {
            s.data.assign(s.src, s.src + source_span(s));
            s.src = s.data.data();
            s.op->waiting = 0;
        }
        if (s.group < 0 || s.group >= done || read) {   // (a vector moved onto itself empties)
            if (&f.stores[keep] != &s) f.stores[keep] = std::move(s);
            ++keep;
            continue;
        }
        land(w, s);
    }
    f.stores.resize(keep);
}

// A thread that exits with stores in flight: they land (before its block's shared memory goes).
void sm90_fiber_end(Worker* w, Fiber* fb) {
    for (BulkStore& s : fb->sm90.stores) land(w, s);
    fb->sm90.stores.clear();
}

// ------------------------------------------------------------------------------------------
// tensor copies: cp.async.bulk.tensor in tile mode, through a map of cuflash.emulator.tma
struct EmuTensorMap {   // cuflash/emulator/tma.py, LAYOUT
    uint32_t magic;
    uint8_t elem, rank, swizzle, oob_nan;
    uint64_t address;
    uint64_t stride[4];
    uint32_t dim_minus_1[5];
    uint16_t box[5];
    uint8_t estride[5];
    uint8_t pad[45];
};
static_assert(sizeof(EmuTensorMap) == 128, "the tensor map is 128 bytes");

static const EmuTensorMap& tensor_map(Worker* w, uint64_t p, int dim, const char* what, const char* file, int line) {
    const EmuTensorMap* m = (const EmuTensorMap*)(uintptr_t)p;
    if (!p || p % 8 || m->magic != 0x50414D54u)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: 0x%llx is not the address of a tensor map made by "
                 "cuflash.emulator.tma.encode_tiled (pass the map as a kernel parameter and give its address)", what,
                 file, line, (unsigned long long)p);
    if (m->rank != dim)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: a .%dd copy through a tensor map of rank %d", what, file, line, dim,
                 m->rank);
    return *m;
}

// Elements a box loads along dimension i: ceil(box / element stride).
static int box_count(const EmuTensorMap& m, int i) { return (m.box[i] + m.estride[i] - 1) / m.estride[i]; }

// Calls f(global byte offset or -1 when out of bounds, shared byte offset from the box's start) for
// each element of the box at `coords`: packed dim 0 fastest, its 16-byte chunks swizzled by the
// address bits of `dst` (the shared address the box starts at) as the tensor map says.
template <class F> static void for_box(const EmuTensorMap& m, const int32_t* coords, uint32_t dst, F f) {
    int64_t count = 1;
    for (int i = 0; i < m.rank; ++i) count *= box_count(m, i);
    const uint32_t mask = m.swizzle ? (uint32_t)(m.swizzle / 16 - 1) : 0;
    int e[5] = {0, 0, 0, 0, 0};
    for (int64_t n = 0; n < count; ++n) {
        int64_t g = 0;
        bool in = true;
        for (int i = 0; i < m.rank; ++i) {
            const int64_t c = (int64_t)coords[i] + (int64_t)e[i] * m.estride[i];
            in &= c >= 0 && c <= (int64_t)m.dim_minus_1[i];
            g += i == 0 ? c * m.elem : c * (int64_t)m.stride[i - 1];
        }
        const uint32_t a = dst + (uint32_t)(n * m.elem);
        f(in ? g : -1, (int64_t)((a ^ ((a >> 7 & mask) << 4)) - dst));
        for (int i = 0; i < m.rank && ++e[i] == box_count(m, i); ++i) e[i] = 0;
    }
}

static uint32_t box_bytes(const EmuTensorMap& m) {
    uint32_t n = m.elem;
    for (int i = 0; i < m.rank; ++i) n *= box_count(m, i);
    return n;
}

// The box's bytes at shared address `smem`, checked: aligned, inside shared memory.
static char* box_at(Worker* w, const EmuTensorMap& m, uint64_t smem, const char* what, const char* file, int line) {
    const uint32_t align = m.swizzle ? 128 : 16;
    if (smem % align)
        ptx_fail(w, EMU_ERROR_BOUNDS, "%s at %s:%d: the shared address 0x%llx of the box is not %u-byte aligned%s", what,
                 file, line, (unsigned long long)smem, align, m.swizzle ? " (a swizzled box)" : "");
    return (char*)(tls_base() + shared_addr(w, smem, 0, (int)box_bytes(m), what, file, line));
}

// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {c...}], [mbar]
EMU_EXPORT void __emu_ptx_tensor_load(int dim, uint64_t dst, uint64_t map, const int32_t* coords, uint64_t mbar,
                                      const char* file, int line) {
    Worker* w = __emu_t_worker;
    const char* what = "cp.async.bulk.tensor";
    const EmuTensorMap& m = tensor_map(w, map, dim, what, file, line);
    char* d = box_at(w, m, dst, what, file, line);
    MBarrier& mb = mbar_at(w, mbar, 0, what, file, line);
    const uint32_t bytes = box_bytes(m);
    BulkCopy* c = bulk_copy(w, d, bytes, what, file, line);
    const char* base = (const char*)(uintptr_t)m.address;
    const bool checked = w->L->checked;
    void* pc = __builtin_return_address(0);
    for_box(m, coords, (uint32_t)dst, [&](int64_t g, int64_t s) {
        char* out = c->data.data() + s;
        if (g >= 0) {
            if (checked) check_access((uintptr_t)(base + g), m.elem, false, pc);
            memcpy(out, base + g, m.elem);
        } else if (m.oob_nan) {   // the OOB-NaN: a quiet NaN of the element type
            const uint64_t nan = m.elem == 2 ? 0x7fffu : m.elem == 4 ? 0x7fffffffu : 0x7fffffffffffffffull;
            memcpy(out, &nan, m.elem);
        } else {
            memset(out, 0, m.elem);
        }
    });
    memset(d, 0xff, bytes);   // NaN until it lands
    mb.copies.push_back(c);
}

// cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group [map, {c...}], [src]
EMU_EXPORT void __emu_ptx_tensor_store(int dim, uint64_t map, const int32_t* coords, uint64_t src, const char* file,
                                       int line) {
    Worker* w = __emu_t_worker;
    const char* what = "cp.async.bulk.tensor (store)";
    const EmuTensorMap& m = tensor_map(w, map, dim, what, file, line);
    const char* box = box_at(w, m, src, what, file, line);
    for (int i = 0; i < dim; ++i)
        if (coords[i] < 0)
            ptx_fail(w, EMU_ERROR_BOUNDS, "%s at %s:%d: coordinate %d is %d; a store's box starts at non-negative "
                     "coordinates", what, file, line, i, coords[i]);
    std::vector<std::pair<int64_t, int64_t>> elems;
    for_box(m, coords, (uint32_t)src, [&](int64_t g, int64_t s) { if (g >= 0) elems.push_back({g, s}); });
    bulk_store(w, (char*)(uintptr_t)m.address, box, box_bytes(m), std::move(elems), m.elem, __builtin_return_address(0),
               what, file, line);
}

// ------------------------------------------------------------------------------------------
// named barriers: bar.sync / bar.arrive / barrier.sync / barrier.arrive with an id and a count
extern "C" void __emu_syncthreads(const char* file, int line);
EMU_EXPORT void __emu_ptx_bar(int id, int count, int arrive, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    if (id < 0 || id > 15) ptx_fail(w, EMU_ERROR_GENERIC, "bar at %s:%d: barrier id %d is not in 0..15", file, line, id);
    if (count < 0) {
        if (arrive) ptx_fail(w, EMU_ERROR_GENERIC, "bar.arrive at %s:%d needs a thread count", file, line);
        count = w->nthreads;
    }
    if (count == 0 || count % 32 || count > ((w->nthreads + 31) & ~31))
        ptx_fail(w, EMU_ERROR_GENERIC, "bar at %s:%d: thread count %d is not a positive multiple of 32 within the "
                 "block's %d threads", file, line, count, w->nthreads);
    if (id == 0 && count >= w->nthreads && !arrive) return __emu_syncthreads(file, line);
    NamedBarrier& b = w->sm90.named[id];
    if (b.expected == 0) b = NamedBarrier{count, 0, file, line};
    else if (b.expected != count)
        hazard(w, 0, 0, false, nullptr, "named barrier %d: thread counts disagree: %d at %s:%d, %d at %s:%d", id,
               b.expected, b.file, b.line, count, file, line);
    f->wfile = file;
    f->wline = line;
    if (++b.arrived == b.expected) {
        for (Fiber& g : w->fibers)
            if (g.state == F_WAIT_NAMED && g.sm90.wait_named == id) g.state = F_RUNNABLE;
        b = NamedBarrier{0, 0, nullptr, 0};
        new_epoch(w);
        return;
    }
    if (arrive) return;
    f->state = F_WAIT_NAMED;
    f->sm90.wait_named = id;
    switch_to_sched(w);
}

// ------------------------------------------------------------------------------------------
// setmaxnreg: the warpgroup meets; .dec gives registers back to the SM at once, .inc waits until
// the SM has them (the ISA: "blocks until sufficient registers are available")
static int regs_total(const Sm90Block& b) {
    int total = 0;
    for (int i = 0; i < 8; ++i) total += 128 * b.regs[i];
    return total;
}

static void regs_release(Worker* w, int g) {
    for (int t = 0; t < 128; ++t) w->fibers[g * 128 + t].state = F_RUNNABLE;
    w->sm90.wg_arrived[g] = 0;
    w->sm90.reg_count[g] = 0;
}

// Grants the waiting .inc that fit now.
static void regs_grant(Worker* w) {
    Sm90Block& b = w->sm90;
    for (int g = 0; g < 8; ++g) {
        if (b.reg_count[g] != 128 || b.reg_value[g] < 0) continue;
        if (regs_total(b) - 128 * b.regs[g] + 128 * b.reg_value[g] > 65536) continue;
        b.regs[g] = b.reg_value[g];
        regs_release(w, g);
    }
}

EMU_EXPORT void __emu_ptx_setmaxnreg(int count, int inc, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    const char* what = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
    if (count < 24 || count > 256 || count % 8)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: %d registers is not a multiple of 8 in 24..256", what, file, line,
                 count);
    const int g = f->linear >> 7;
    if ((g + 1) * 128 > w->nthreads)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: warpgroup %d of the block is incomplete", what, file, line, g);
    Sm90Block& b = w->sm90;
    const int value = inc ? count : -count;
    if (b.reg_count[g] == 0) b.reg_value[g] = value;
    else if (b.reg_value[g] != value)
        ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: the threads of warpgroup %d disagree (%s %d against %s %d): every "
                 "warp of the warpgroup must execute the same setmaxnreg", what, file, line, g, what, count,
                 b.reg_value[g] > 0 ? "inc" : "dec", b.reg_value[g] > 0 ? b.reg_value[g] : -b.reg_value[g]);
    f->wfile = file;
    f->wline = line;
    f->op = EMU_WG_SETMAXNREG;
    f->state = F_WAIT_WG;
    b.wg_arrived[g]++;
    if (++b.reg_count[g] == 128) {
        if (inc ? count < b.regs[g] : count > b.regs[g])
            ptx_fail(w, EMU_ERROR_GENERIC, "%s at %s:%d: warpgroup %d holds %d registers per thread; %s needs a count "
                     "%s it", what, file, line, g, b.regs[g], what, inc ? "at least" : "at most");
        if (!inc) {
            b.regs[g] = count;
            regs_release(w, g);
        }
        regs_grant(w);
    }
    switch_to_sched(w);
}

// elect.sync: the lowest lane of `mask` leads (the ISA leaves the choice to the hardware)
EMU_EXPORT unsigned __emu_ptx_elect(unsigned mask, const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    f->val = 1;
    const unsigned ballot = (unsigned)warp_op_common(w, f, EMU_WARP_BALLOT, mask, file, line);
    return ballot ? (unsigned)__builtin_ctz(ballot) : 0u;
}

// stmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16 [addr], {r...}
EMU_EXPORT void __emu_ptx_stmatrix(int num, int trans, int generic, uint64_t addr, const uint32_t* r,
                                   const char* file, int line) {
    Worker* w = __emu_t_worker;
    Fiber* f = w->cur;
    const int lane = f->linear & 31;
    StmatrixCall call;
    memset(&call, 0, sizeof(call));
    memcpy(call.lane.r, r, sizeof(uint32_t) * num);
    call.num = num;
    call.trans = trans;
    if (lane < 8 * num) {   // lanes 8j..8j+7 address the rows of matrix j
        if (addr % 16)
            ptx_fail(w, EMU_ERROR_BOUNDS, "stmatrix at %s:%d: lane %d gives row address 0x%llx, which is not 16-byte "
                     "aligned (each row is 16 bytes)", file, line, lane, (unsigned long long)addr);
        const uintptr_t p = shared_ptr(w, addr, generic, 16);
        if (!p)
            ptx_fail(w, EMU_ERROR_BOUNDS, "stmatrix at %s:%d: lane %d gives row address 0x%llx: its 16 bytes are not "
                     "inside a __shared__ variable or the launch's %llu bytes of dynamic shared memory", file, line, lane,
                     (unsigned long long)addr, w->L->shmem);
        if (w->L->checked) check_access(p, 16, true, __builtin_return_address(0));
        call.lane.row = (uint16_t*)p;
    }
    aligned_op(w, f, EMU_WARP_STMATRIX, &call, __builtin_return_address(0), file, line);
}

// ------------------------------------------------------------------------------------------
// the scheduler's hooks
// Nothing can run: the copies on the mbarriers that threads wait for land (and no others).
bool sm90_progress(Worker* w) {
    bool any = false;
    for (const Fiber& f : w->fibers) {
        if (f.state != F_WAIT_MBAR) continue;
        auto it = w->sm90.mbar.find(f.sm90.wait_mbar);
        if (it != w->sm90.mbar.end() && it->second.valid) any |= mbar_land(w, it->first, it->second);
    }
    return any;
}

const char* sm90_wait_name(const Fiber& f) {
    return f.state == F_WAIT_MBAR ? "mbarrier.try_wait" : f.state == F_WAIT_NAMED ? "a named barrier (bar.sync)" : "?";
}

void sm90_describe(Worker* w, EmuError* e, const Fiber& f) {
    if (f.state == F_WAIT_MBAR) {
        auto it = w->sm90.mbar.find(f.sm90.wait_mbar);
        if (it == w->sm90.mbar.end()) return;
        const MBarrier& m = it->second;
        emsg(e, ", on the mbarrier at shared address 0x%x initialised at %s:%d: it is in phase %llu with %d of %d "
                "arrivals and %lld transaction bytes pending; the wait is for %s %llu", f.sm90.wait_mbar, m.file, m.line,
             (unsigned long long)m.phase, m.pending, m.expected, (long long)m.tx,
             f.sm90.wait_parity ? "the phase of parity" : "the end of phase", (unsigned long long)f.sm90.wait_phase);
    } else if (f.state == F_WAIT_NAMED) {
        const NamedBarrier& b = w->sm90.named[f.sm90.wait_named];
        emsg(e, ", on barrier %d: %d of %d threads arrived", f.sm90.wait_named, b.arrived, b.expected);
    } else if (f.state == F_WAIT_WG) {
        const int g = f.linear >> 7;
        const Sm90Block& b = w->sm90;
        emsg(e, ", warpgroup %d: %d of 128 threads arrived", g, b.wg_arrived[g]);
        if (f.op == EMU_WG_SETMAXNREG && b.reg_count[g] == 128)
            emsg(e, "; it waits for %d registers per thread, which the SM's 65536 cannot give while the block's "
                    "warpgroups hold %d, %d, %d, %d, ... per thread", b.reg_value[g], b.regs[0], b.regs[1], b.regs[2],
                 b.regs[3]);
    }
}
