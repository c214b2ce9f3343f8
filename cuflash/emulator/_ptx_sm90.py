"""Inline PTX for the CPU emulator: Hopper's asynchronous instructions (sm_90; wgmma and
setmaxnreg on sm_90a).

A mixin of the translator's emitter (:mod:`._ptx`): each handler turns one instruction into
calls into the runtime (``__emu_ptx_*`` in runtime/shim.h, runtime/sm90.cpp), as the
``mma.sync`` handlers do. A wgmma's accumulators are passed by address: it computes when its
warpgroup meets, but its results land in the registers only at the ``wgmma.wait_group`` that
retires it.
"""
from __future__ import annotations

import re

SUPPORTED = ("mbarrier.{init,inval,arrive,arrive.expect_tx,expect_tx,complete_tx,try_wait,test_wait}{,.parity}, "
             "cp.async.mbarrier.arrive{,.noinc}, cp.async.bulk{,.tensor.{1..5}d} (global to shared with an mbarrier, "
             "shared to global with a bulk group), cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32, "
             "cp.async.bulk.{commit_group,wait_group{,.read}}, "
             "prefetch.tensormap, fence.proxy.async, "
             "fence.mbarrier_init, bar/barrier.{sync,arrive} with an id and count, elect.sync, "
             "stmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.b16, mov (sm_90); setmaxnreg, wgmma.fence, "
             "wgmma.commit_group, wgmma.wait_group, wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}, "
             "wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32 (sm_90a)")

_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k(8|16)\.f32\.(f16|bf16|tf32)\.(f16|bf16|tf32)")
_MBARRIER = re.compile(r"mbarrier\.(init|inval|arrive|expect_tx|complete_tx|try_wait|test_wait)((?:\.[\w:]+)*)\.b64")
_CP_MBAR = re.compile(r"cp\.async\.mbarrier\.arrive((?:\.[\w:]+)*)\.b64")
_BULK = re.compile(r"cp\.async\.bulk\.(shared::cluster|shared::cta|global)\.(global|shared::cta)((?:\.[\w:]+)*)")
_TENSOR = re.compile(r"cp\.async\.bulk\.tensor\.([1-5])d\.(shared::cluster|shared::cta|global)\.(global|shared::cta)"
                     r"((?:\.[\w:]+)*)")
_BULK_RED = re.compile(r"cp\.reduce\.async\.bulk\.(global)\.(shared::cta)((?:\.[\w:]+)*)")
_BULK_WAIT = re.compile(r"cp\.async\.bulk\.wait_group(\.read)?")
_BAR = re.compile(r"(bar|barrier)(?:\.cta)?\.(sync|arrive)(\.aligned)?")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32")
_STMATRIX = re.compile(r"stmatrix\.sync\.aligned((?:\.[\w:]+)*)\.b16")
_MOV = re.compile(r"mov\.([bsu])(32|64)")
_SPACES = {"shared", "shared::cta", "shared::cluster"}
_ORDER = {"release", "acquire", "relaxed", "cta", "cluster"}


_TYPE_ENUM = {"f16": "EMU_MMA_F16", "bf16": "EMU_MMA_BF16", "tf32": "EMU_MMA_TF32"}


def _quals(text: str) -> list:
    """The qualifiers of an opcode's tail (".shared::cta.b64" -> ["shared::cta", "b64"])."""
    return [q for q in text.split(".") if q]


class Sm90Instructions:
    """The emitter's handlers for sm_90a instructions (mixed into ``_ptx._Emitter``)."""

    def patterns(self):
        return ((_WGMMA, self._wgmma), (_MBARRIER, self._mbarrier), (_CP_MBAR, self._cp_mbar),
                (_TENSOR, self._tensor), (_BULK, self._bulk), (_BULK_RED, self._bulk_reduce),
                (_BULK_WAIT, self._bulk_wait), (_BAR, self._bar), (_SETMAXNREG, self._setmaxnreg),
                (_STMATRIX, self._stmatrix), (_MOV, self._mov))

    def simple(self):
        fences = {f"fence.proxy.async{s}": self._fence_proxy_async
                  for s in ("", ".shared::cta", ".shared::cluster", ".global")}
        return {**fences, "fence.mbarrier_init.release.cluster": self._fence_mbarrier_init,
                "cp.async.bulk.commit_group": self._bulk_commit, "elect.sync": self._elect,
                "prefetch.tensormap": self._prefetch_tensormap, "prefetch.param.tensormap": self._prefetch_tensormap,
                "prefetch.const.tensormap": self._prefetch_tensormap,
                "wgmma.fence.sync.aligned": self._wgmma_fence,
                "wgmma.commit_group.sync.aligned": self._wgmma_commit,
                "wgmma.wait_group.sync.aligned": self._wgmma_wait}

    def _need_sm90a(self, opcode: str):
        if not (self.arch.specific and self.arch.cuda_arch == 900):
            self.fail(f"`{opcode}` needs sm_90a (the architecture-specific target); the emulated architecture "
                      f"is {self.arch.name}, where ptxas rejects it too (pass RawModule(arch=\"sm_90a\"))")

    def _fence_proxy_async(self, instr):
        self._need(instr.opcode, 900)
        self._count(instr, 0)
        self.calls.append("__emu_ptx_fence_proxy_async();")

    def _wgmma_fence(self, instr):
        self._need_sm90a(instr.opcode)
        self._count(instr, 0)
        # orders register accesses around wgmma on a GPU; the emulator's wgmma reads its
        # registers when the warpgroup meets, so there is nothing to do

    def _wgmma_commit(self, instr):
        self._need_sm90a(instr.opcode)
        self._count(instr, 0)
        self.calls.append(f"__emu_ptx_wgmma_commit({self._where()});")

    def _wgmma_wait(self, instr):
        self._need_sm90a(instr.opcode)
        self._count(instr, 1)
        n = self._imm(instr.operands[0], "wgmma.wait_group N")
        self.calls.append(f"__emu_ptx_wgmma_wait({n}, {self._where()});")

    def _wgmma(self, instr, m):
        self._need_sm90a(instr.opcode)
        n, k, ta, tb = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        tf32 = ta == "tf32"
        if ta != tb or tf32 != (k == 8) or not (8 <= n <= 256 and n % 8 == 0):
            self.fail(f"`{instr.opcode}` is not a wgmma.mma_async form: the ISA has m64nNk16 for .f16/.bf16 and "
                      "m64nNk8 for .tf32, both types alike, N a multiple of 8 from 8 to 256")
        ops = instr.operands
        a_regs = bool(ops) and len(ops) > 1 and ops[1][0] == "list"
        # d, a, b-desc, scale-d, imm-scale-a, imm-scale-b[, imm-trans-a][, imm-trans-b]
        want = 6 + (0 if tf32 else 1 if a_regs else 2)
        self._count(instr, want)
        d, a, b, scale_d = ops[:4]
        dregs = self._list(d, n // 2, "wgmma.mma_async D")
        for o in dregs:
            if o[0] != "ref":
                self.fail("wgmma.mma_async D must be asm operands (the accumulators' variables)")
            self._reg(o, 32, "wgmma.mma_async D", out=True)
            self.byref.add(o[1])
        # immediates: a literal is checked here, an "n" operand by the runtime
        imms = [self._imm(o, "wgmma.mma_async immediate") for o in ops[4:]]
        scale_a, scale_b = imms[0], imms[1]
        for what, v, allowed in (("imm-scale-a", scale_a, ("1", "-1")), ("imm-scale-b", scale_b, ("1", "-1")),
                                 *(("imm-trans", v, ("0", "1")) for v in imms[2:])):
            if v.lstrip("-").isdigit() and v not in allowed:
                self.fail(f"`{instr.opcode}`: {what} must be {' or '.join(allowed)}, got {v}")
        trans = imms[2:]
        trans_a = trans[0] if not tf32 and not a_regs else "0"
        trans_b = trans[-1] if not tf32 else "0"
        if a_regs:
            regs = self._list(a, 4, "wgmma.mma_async A")
            vals = [self._reg(o, 32, "wgmma.mma_async A") for o in regs]
            lvs = []   # where an A register lives, if it is a variable: checked mode guards it
            for i, o in enumerate(regs):
                if o[0] == "ref" and self.ops[o[1]].tied is None and not self.ops[o[1]].mode:
                    self.byref.add(o[1])
                    fwd = f"std::forward<decltype(__r{o[1]})>(__r{o[1]})"
                    lvs.append(f"__emu_ptx_lvalue({fwd})")
                    vals[i] = f"__emu_ptx_rvalue_bits({fwd})"   # a variable is read by the runtime
                else:
                    lvs.append("nullptr")
            a_desc = "0"
            a_arr = f"const uint32_t __a[4] = {{{', '.join(vals)}}}; const void* const __alv[4] = {{{', '.join(lvs)}}};"
            a_args = "__a, __alv"
        else:
            a_desc = self._reg(a, 64, "wgmma.mma_async A descriptor")
            a_arr, a_args = "", "nullptr, nullptr"
        b_desc = self._reg(b, 64, "wgmma.mma_async B descriptor")
        scale = self._pred(scale_d, "wgmma.mma_async scale-d")
        tc = self.arch.mma
        block = tc.block_k_tf32 if tf32 else tc.block_k_f16
        addrs = ", ".join(f"(uint32_t*)&__r{o[1]}" for o in dregs)
        self.calls.append(
            f"{{ {a_arr} uint32_t* const __d[{n // 2}] = {{{addrs}}}; "
            f"__emu_ptx_wgmma({n}, {k}, {_TYPE_ENUM[ta]}, {a_desc}, {a_args}, {b_desc}, {scale}, "
            f"{scale_a}, {scale_b}, {trans_a}, {trans_b}, __d, "
            f"{block}, {tc.extra_bits}, {tc.min_exponent}, {self._where()}); }}")

    # -- sm_90: mbarrier, bulk copies, named barriers, elect, stmatrix
    def _unknown(self, instr):
        self.fail(f"inline PTX instruction `{instr.opcode}` is not supported by the CPU emulator (it runs {SUPPORTED})")

    def _fence_mbarrier_init(self, instr):
        self._need(instr.opcode, 900)
        self._count(instr, 0)   # mbarrier.init is visible to the block at once here

    def _mbar_addr(self, o, quals, what):
        """(address expression, generic flag) of an mbarrier operand."""
        return self._addr(o, what), 0 if set(quals) & _SPACES else 1

    def _mbarrier(self, instr, m):
        self._need(instr.opcode, 900)
        op, quals = m.group(1), _quals(m.group(2))
        parity = "parity" in quals
        extra = set(quals) - _SPACES - _ORDER - {"parity", "expect_tx"} if op == "arrive" else \
            set(quals) - _SPACES - _ORDER - ({"parity"} if op in ("try_wait", "test_wait") else set())
        if extra or ("expect_tx" in quals and op != "arrive"):
            self._unknown(instr)
        ops = instr.operands
        w = self._where()
        if op == "init":
            self._count(instr, 2)
            addr, gen = self._mbar_addr(ops[0], quals, "mbarrier.init address")
            self.calls.append(f"__emu_ptx_mbar_init({addr}, {gen}, (int){self._reg(ops[1], 32, 'mbarrier count')}, {w});")
        elif op == "inval":
            self._count(instr, 1)
            addr, gen = self._mbar_addr(ops[0], quals, "mbarrier.inval address")
            self.calls.append(f"__emu_ptx_mbar_inval({addr}, {gen}, {w});")
        elif op == "arrive":
            self._count(instr, 2, 3)
            addr, gen = self._mbar_addr(ops[1], quals, "mbarrier.arrive address")
            n = f"(int){self._reg(ops[2], 32, 'mbarrier.arrive count')}" if len(ops) == 3 else "1"
            count, tx = ("1", f"(int64_t){n}") if "expect_tx" in quals else (n, "0")
            if "expect_tx" in quals and len(ops) != 3:
                self.fail("`mbarrier.arrive.expect_tx` needs the transaction count")
            call = f"__emu_ptx_mbar_arrive({addr}, {gen}, {count}, {tx}, {w})"
            if ops[0][0] == "sink":
                self.calls.append(call + ";")
            else:
                self.calls.append(f"__emu_ptx_set({self._reg(ops[0], 64, 'mbarrier state', out=True)}, "
                                  f"(uint64_t){call});")
        elif op in ("expect_tx", "complete_tx"):
            self._count(instr, 2)
            addr, gen = self._mbar_addr(ops[0], quals, f"mbarrier.{op} address")
            tx = self._reg(ops[1], 32, "transaction count")
            self.calls.append(f"__emu_ptx_mbar_tx({addr}, {gen}, (int64_t){tx}, {int(op == 'complete_tx')}, {w});")
        else:   # try_wait / test_wait
            self._count(instr, 3, 4) if op == "try_wait" else self._count(instr, 3)
            addr, gen = self._mbar_addr(ops[1], quals, f"mbarrier.{op} address")
            phase = (f"(uint64_t){self._reg(ops[2], 32, 'phase parity')}" if parity
                     else self._reg(ops[2], 64, "mbarrier state"))
            done = self._pred(ops[0], f"mbarrier.{op} result", out=True)
            self.calls.append(f"{done} = __emu_ptx_mbar_wait({addr}, {gen}, {phase}, {int(parity)}, "
                              f"{int(op == 'try_wait')}, {w});")

    def _cp_mbar(self, instr, m):
        self._need(instr.opcode, 800)
        quals = _quals(m.group(1))
        if set(quals) - _SPACES - {"noinc"}:
            self._unknown(instr)
        self._count(instr, 1)
        addr, gen = self._mbar_addr(instr.operands[0], quals, "cp.async.mbarrier.arrive address")
        self.calls.append(f"__emu_ptx_cp_async_mbar_arrive({addr}, {gen}, {int('noinc' in quals)}, {self._where()});")

    def _bulk(self, instr, m):
        self._need(instr.opcode, 900)
        dst, src, quals = m.group(1), m.group(2), _quals(m.group(3))
        hint = "L2::cache_hint" in quals
        rest = set(quals) - {"L2::cache_hint"}
        ops = instr.operands
        if dst.startswith("shared") and src == "global" and rest == {"mbarrier::complete_tx::bytes"}:
            self._count(instr, 5 if hint else 4)
            self.calls.append(
                f"__emu_ptx_bulk_load({self._addr(ops[0], 'cp.async.bulk destination')}, "
                f"{self._addr(ops[1], 'cp.async.bulk source')}, {self._reg(ops[2], 32, 'cp.async.bulk size')}, "
                f"{self._addr(ops[3], 'cp.async.bulk mbarrier')}, {self._where()});")
        elif dst == "global" and src == "shared::cta" and rest == {"bulk_group"}:
            self._count(instr, 4 if hint else 3)
            self.calls.append(
                f"__emu_ptx_bulk_store({self._addr(ops[0], 'cp.async.bulk destination')}, "
                f"{self._addr(ops[1], 'cp.async.bulk source')}, {self._reg(ops[2], 32, 'cp.async.bulk size')}, "
                f"{self._where()});")
        else:
            self._unknown(instr)

    def _bulk_reduce(self, instr, m):
        """cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: the floats at the shared
        source added to those at the global destination, as atomics, when the group completes."""
        self._need(instr.opcode, 900)
        quals = _quals(m.group(3))
        hint = "L2::cache_hint" in quals
        if [q for q in quals if q != "L2::cache_hint"] != ["bulk_group", "add", "f32"]:
            self._unknown(instr)
        self._count(instr, 4 if hint else 3)
        ops = instr.operands
        self.calls.append(
            f"__emu_ptx_bulk_reduce_add_f32({self._addr(ops[0], 'cp.reduce.async.bulk destination')}, "
            f"{self._addr(ops[1], 'cp.reduce.async.bulk source')}, "
            f"{self._reg(ops[2], 32, 'cp.reduce.async.bulk size')}, {self._where()});")

    def _tensor(self, instr, m):
        self._need(instr.opcode, 900)
        dim, dst, src, quals = int(m.group(1)), m.group(2), m.group(3), _quals(m.group(4))
        hint = "L2::cache_hint" in quals
        rest = set(quals) - {"L2::cache_hint", "tile"}
        ops = instr.operands

        def tensor(o):
            if o[0] != "tensor":
                self.fail(f"`{instr.opcode}` needs a tensor operand `[tensorMap, {{c0, ...}}]`")
            coords = [f"(int32_t){self._reg(c, 32, 'tensor coordinate')}" for c in self._list(o[2], dim, "coordinates")]
            base = o[1]
            if base[0] != "ref" or self.ops[base[1]].kind != "l":
                self.fail("the tensor map must be an \"l\" operand: the map's generic address")
            return f"(uint64_t){self._var(base[1])}", f"const int32_t __c[{dim}] = {{{', '.join(coords)}}};"

        if dst.startswith("shared") and src == "global" and rest == {"mbarrier::complete_tx::bytes"}:
            self._count(instr, 4 if hint else 3)
            tmap, coords = tensor(ops[1])
            self.calls.append(f"{{ {coords} __emu_ptx_tensor_load({dim}, {self._addr(ops[0], 'destination')}, {tmap}, "
                              f"__c, {self._addr(ops[2], 'mbarrier')}, {self._where()}); }}")
        elif dst == "global" and src == "shared::cta" and rest == {"bulk_group"}:
            self._count(instr, 3 if hint else 2)
            tmap, coords = tensor(ops[0])
            self.calls.append(f"{{ {coords} __emu_ptx_tensor_store({dim}, {tmap}, __c, "
                              f"{self._addr(ops[1], 'source')}, {self._where()}); }}")
        else:
            self._unknown(instr)

    def _prefetch_tensormap(self, instr):
        self._need(instr.opcode, 900)
        self._count(instr, 1)
        self._addr(instr.operands[0], "prefetch.tensormap address")   # a hint: nothing to do

    def _bulk_commit(self, instr):
        self._need(instr.opcode, 900)
        self._count(instr, 0)
        self.calls.append("__emu_ptx_bulk_commit();")

    def _bulk_wait(self, instr, m):
        self._need(instr.opcode, 900)
        self._count(instr, 1)
        self.calls.append(f"__emu_ptx_bulk_wait({self._imm(instr.operands[0], 'cp.async.bulk.wait_group N')}, "
                          f"{int(m.group(1) is not None)}, {self._where()});")

    def _bar(self, instr, m):
        arrive = m.group(2) == "arrive"
        self._count(instr, 2) if arrive else self._count(instr, 1, 2)
        ops = instr.operands
        bid = f"(int){self._reg(ops[0], 32, 'barrier id')}"
        count = f"(int){self._reg(ops[1], 32, 'barrier thread count')}" if len(ops) == 2 else "-1"
        self.calls.append(f"__emu_ptx_bar({bid}, {count}, {int(arrive)}, {self._where()});")

    def _setmaxnreg(self, instr, m):
        self._need_sm90a(instr.opcode)
        self._count(instr, 1)
        n = self._imm(instr.operands[0], "setmaxnreg count")
        self.calls.append(f"__emu_ptx_setmaxnreg({n}, {int(m.group(1) == 'inc')}, {self._where()});")

    def _elect(self, instr):
        self._need(instr.opcode, 900)
        self._count(instr, 2)
        out, mask = instr.operands
        if out[0] != "pair":
            self.fail("`elect.sync` writes `d|p`: a register (or _) and a predicate")
        d, p = out[1], out[2]
        code = f"{{ const unsigned __leader = __emu_ptx_elect({self._reg(mask, 32, 'elect.sync mask')}, {self._where()}); "
        if d[0] != "sink":
            code += f"__emu_ptx_set({self._reg(d, 32, 'elect.sync d', out=True)}, __leader); "
        code += f"{self._pred(p, 'elect.sync p', out=True)} = __emu_ptx_lane() == __leader; }}"
        self.calls.append(code)

    def _stmatrix(self, instr, m):
        self._need(instr.opcode, 900)
        quals = _quals(m.group(1))
        nums = [q for q in quals if q in ("x1", "x2", "x4")]
        if "m8n8" not in quals or len(nums) != 1 or set(quals) - {"m8n8", "trans", *nums} - _SPACES:
            self._unknown(instr)
        num = int(nums[0][1])
        self._count(instr, 2)
        addr, regs = instr.operands
        vals = [self._reg(o, 32, "stmatrix source") for o in self._list(regs, num, "stmatrix source")]
        generic = 0 if set(quals) & _SPACES else 1
        self.calls.append(f"{{ const uint32_t __r[4] = {{{', '.join(vals)}}}; __emu_ptx_stmatrix({num}, "
                          f"{int('trans' in quals)}, {generic}, {self._addr(addr, 'stmatrix address')}, __r, "
                          f"{self._where()}); }}")

    def _mov(self, instr, m):
        bits = int(m.group(2))
        self._count(instr, 2)
        d, a = instr.operands
        self.calls.append(f"__emu_ptx_set({self._reg(d, bits, 'mov destination', out=True)}, "
                          f"({'uint64_t' if bits == 64 else 'uint32_t'}){self._reg(a, bits, 'mov source')});")
