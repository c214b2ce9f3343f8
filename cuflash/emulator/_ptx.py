"""Inline PTX for the CPU emulator.

A kernel keeps one source: the ``asm volatile("mma.sync...")`` a GPU runs is also what the
emulator runs. After g++ has preprocessed the translation unit, :func:`translate` finds every
``asm`` statement of the user's files (GCC extended-asm syntax: template strings, ``:`` outputs,
``:`` inputs, ``:`` clobbers), parses its PTX, checks each instruction against the emulated
architecture, and replaces the statement by calls into the runtime (``__emu_ptx_*`` in
runtime/shim.h) on one line followed by the statement's own newlines, so line numbers hold.

An instruction the emulator does not know, or the architecture lacks, becomes a call to a
function declared with GCC's ``error`` attribute: g++ reports it only where the call survives
dead-code elimination, so, as with ptxas, a wrapper no kernel reaches (an uninstantiated
template, a branch on ``__CUDA_ARCH__``) does no harm. _build turns the report into an
:class:`EmulatorCompileError` naming the instruction and its ``file:line``.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from ._errors import EmulatorCompileError
from ._ptx_sm90 import SUPPORTED as _SUPPORTED_SM90, Sm90Instructions
from .archs import Arch

SUPPORTED = ("mma.sync.aligned.{m16n8k16,m16n8k8}.row.col.f32.{f16,bf16,tf32}.{f16,bf16,tf32}.f32, "
             "ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16, cp.async.{ca,cg}.shared.global, "
             "cp.async.commit_group, cp.async.wait_group, cp.async.wait_all, cvt.rn.{f16x2,bf16x2}.f32, "
             "cvt.rna.tf32.f32, ex2.approx{,.ftz}.f32, setp, selp, bra, " + _SUPPORTED_SM90)

# what an operand constraint puts in a register: C type of the temporary, bits
_CONSTRAINTS = {"r": ("uint32_t", 32), "h": ("uint16_t", 16), "l": ("uint64_t", 64), "f": ("float", 32),
                "d": ("double", 64), "n": ("long long", 0)}

_LEX = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|\b(asm|__asm__|__asm)\b')
_MARKER = re.compile(r'^# (\d+) "((?:\\.|[^"\\])*)"([ \d]*)$', re.M)
_QUALIFIERS = ("volatile", "__volatile__", "__volatile", "inline", "__inline", "__inline__")
ERROR_FUNCTION = "__emu_ptx_error_"   # + a number: the functions of deferred errors


@dataclass
class Operand:
    index: int
    kind: str          # constraint letter: r h l f d n
    mode: str          # "=" output, "+" in-out, "" input
    expr: str
    name: str | None
    tied: int | None   # an input tied to output `tied` ("0")


@dataclass
class Site:
    file: str
    line: int

    def __str__(self):
        return f"{self.file}:{self.line}"


class _Error(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# the translation unit
def translate(text: str, arch: Arch) -> str:
    """`text` (g++ -E output) with every asm statement of a non-system file replaced by runtime calls."""
    markers = [(m.start(), int(m.group(1)), _unescape(m.group(2)), "3" in m.group(3).split())
               for m in _MARKER.finditer(text)]
    starts = [m[0] for m in markers]
    out, pos, errors = [], 0, 0
    for m in _LEX.finditer(text):
        if not m.group(1) or m.start() < pos:
            continue
        i = bisect.bisect_right(starts, m.start()) - 1
        if i >= 0 and markers[i][3]:
            continue   # a system header's asm (glibc symbol names): not device code
        if i >= 0:
            line = markers[i][1] + text.count("\n", text.index("\n", markers[i][0]) + 1, m.start())
            site = Site(markers[i][2], line)
        else:
            site = Site("<source>", text.count("\n", 0, m.start()) + 1)
        try:
            body, end = _extent(text, m.end())
        except _Error as e:
            raise EmulatorCompileError(f"{site}: {e}") from None
        try:
            code = _statement(body, site, arch)
        except _Error as e:
            errors += 1
            msg = f"{site}: {e}".replace("\\", "\\\\").replace('"', '\\"')
            name = f"{ERROR_FUNCTION}{errors}"
            code = (f'do {{ extern void {name}(void) __attribute__((error("{msg}"))); {name}(); }} while (0)')
        out += [text[pos:m.start()], code, "\n" * text.count("\n", m.start(), end)]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _unescape(s: str) -> str:
    return s.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _balanced(text: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at text[i]."""
    depth = 0
    for m in re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[()]').finditer(text, i):
        tok = m.group()
        if tok == "(":
            depth += 1
        elif tok == ")":
            depth -= 1
            if depth == 0:
                return m.end()
    raise _Error("unterminated asm statement")


def _split_top(s: str, sep: str) -> list:
    """`s` split at `sep` characters outside brackets, parentheses and literals."""
    parts, depth, cur = [], 0, []
    for m in re.finditer(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|.', s, re.S):
        tok = m.group()
        if tok in "([{":
            depth += 1
        elif tok in ")]}":
            depth -= 1
        if tok == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(tok)
    parts.append("".join(cur))
    return parts


# ---------------------------------------------------------------------------------------------
# one asm statement
def _extent(text: str, i: int) -> tuple:
    """(what is inside the parentheses of the asm statement whose keyword ends at i, the index
    just past them)."""
    while True:
        m = re.compile(r"\s*(\w+)").match(text, i)
        if m and m.group(1) in _QUALIFIERS:
            i = m.end()
        elif m and m.group(1) == "goto":
            raise _Error("asm goto is not supported by the CPU emulator")
        else:
            break
    m = re.compile(r"\s*\(").match(text, i)
    if not m:
        raise _Error("expected `(` after asm")
    end = _balanced(text, m.end() - 1)
    return text[m.end():end - 1], end


def _statement(body: str, site: Site, arch: Arch) -> str:
    """The C++ that replaces an asm statement (`body`: inside its parentheses)."""
    sections = _split_top(body, ":")
    if len(sections) > 4:
        raise _Error("asm goto labels are not supported by the CPU emulator")
    strings = re.findall(r'"((?:\\.|[^"\\])*)"', sections[0])
    if not strings or re.sub(r'"(?:\\.|[^"\\])*"', "", sections[0]).strip():
        raise _Error("the asm template must be string literals")
    template = "".join(_unescape(s) for s in strings)
    outputs = _operands(sections[1] if len(sections) > 1 else "", 0, output=True)
    inputs = _operands(sections[2] if len(sections) > 2 else "", len(outputs), output=False)
    ops = outputs + inputs
    for op in inputs:
        if op.tied is not None:
            if not 0 <= op.tied < len(outputs):
                raise _Error(f"operand {op.index} is tied to %{op.tied}, which is not an output")
            op.kind = outputs[op.tied].kind
    instrs, regs = _instructions(_substitute(template, ops))
    emitter = _Emitter(ops, site, arch, regs)
    for instr in instrs:
        emitter.statement(instr)
    return emitter.code()


_OPERAND = re.compile(r'\s*(?:\[\s*(\w+)\s*\])?\s*((?:"(?:\\.|[^"\\])*"\s*)+)\((.*)\)\s*$', re.S)


def _operands(section: str, first: int, output: bool) -> list:
    if not section.strip():
        return []
    ops = []
    for k, part in enumerate(_split_top(section, ",")):
        m = _OPERAND.match(part)
        if not m:
            raise _Error(f"cannot parse asm operand `{part.strip()}`")
        c = "".join(re.findall(r'"((?:\\.|[^"\\])*)"', m.group(2))).replace("&", "")
        mode = c[0] if c[:1] in ("=", "+") else ""
        letter = c[len(mode):]
        tied = int(letter) if letter.isdigit() else None
        if (mode != "") != output:
            raise _Error(f"operand `{part.strip()}`: {'outputs need `=` or `+`' if output else 'an input has no `=`/`+`'}")
        if tied is None and letter not in _CONSTRAINTS:
            raise _Error(f"asm operand constraint \"{c}\" is not one of r h l f d n")
        if output and letter == "n":
            raise _Error("an output operand cannot be an immediate (\"n\")")
        ops.append(Operand(first + k, letter if tied is None else "", mode, m.group(3).strip(), m.group(1), tied))
    return ops


def _substitute(template: str, ops: list) -> str:
    """The template with %N / %[name] replaced by `\\x00N\\x00` and %% by %."""
    names = {op.name: op.index for op in ops if op.name}

    def sub(m):
        if m.group(1) == "%":
            return "%"
        if m.group(2) is not None:
            if m.group(2) not in names:
                raise _Error(f"asm template names %[{m.group(2)}], which is no operand")
            return f"\0{names[m.group(2)]}\0"
        n = int(m.group(3))
        if n >= len(ops):
            raise _Error(f"asm template uses %{n} but the statement has {len(ops)} operand(s)")
        return f"\0{n}\0"
    return re.sub(r"%(?:(%)|\[(\w+)\]|(\d+))", sub, template)


@dataclass
class Instr:
    opcode: str
    text: str                   # the operands, parsed once the opcode is known
    labels: tuple = ()          # PTX labels that mark this instruction
    guard: tuple | None = None  # (predicate name, negated) of `@p` / `@!p`
    names: frozenset = frozenset()   # the statement's own registers (`.reg`)

    @property
    def operands(self) -> list:
        """Each ("ref", n) | ("imm", text) | ("list", [...]) | ("addr", base, offset) |
        ("local", name) | ("sink",)."""
        return [_operand(o, self.names) for o in _split_top(self.text, ",") if o.strip()]


# the PTX register types a statement may declare with `.reg`: C type, bits
_REG_TYPES = {"pred": ("bool", 1), "b32": ("uint32_t", 32), "u32": ("uint32_t", 32), "s32": ("uint32_t", 32),
              "b64": ("uint64_t", 64), "u64": ("uint64_t", 64), "s64": ("uint64_t", 64), "f32": ("uint32_t", 32)}
_LABEL = re.compile(r"([A-Za-z_$][\w$]*)\s*:(?!:)")


def _instructions(ptx: str) -> tuple:
    """(the instructions, {name: PTX type} of the registers the statement declares)."""
    ptx = re.sub(r"//[^\n]*|/\*.*?\*/", " ", ptx, flags=re.S)
    out, regs, labels = [], {}, []
    for stmt in ptx.split(";"):
        # braces before an opcode open or close a scope: harmless around plain instructions
        stmt = stmt.strip().lstrip("{} \t\n")
        while True:
            m = _LABEL.match(stmt)
            if not m:
                break
            labels.append(m.group(1))
            stmt = stmt[m.end():].strip().lstrip("{} \t\n")
        if not stmt:
            continue
        if stmt.startswith(".reg"):
            m = re.fullmatch(r"\.reg\s+\.(\w+)\s+(%?[A-Za-z_$][\w$]*(?:\s*,\s*%?[A-Za-z_$][\w$]*)*)",
                             stmt.rstrip("} \t\n"))
            if not m or m.group(1) not in _REG_TYPES:
                raise _Error(f"PTX declaration `{_show(stmt)}` is not supported by the CPU emulator (it takes "
                             f"`.reg .{{{','.join(_REG_TYPES)}}} name, ...;`)")
            for name in re.split(r"\s*,\s*", m.group(2)):
                regs[name] = m.group(1)
            continue
        guard = None
        m = re.match(r"@(!?)(%?[A-Za-z_$][\w$]*)\s+", stmt)
        if m:
            if regs.get(m.group(2)) != "pred":
                raise _Error(f"`{_show(stmt)}`: the guard {m.group(2)} is not a .pred register of the statement")
            guard = (m.group(2), bool(m.group(1)))
            stmt = stmt[m.end():]
        opcode, _, rest = stmt.replace("\t", " ").replace("\n", " ").partition(" ")
        out.append(Instr(opcode.strip(), rest, tuple(labels), guard))
        labels = []
    if labels:
        out.append(Instr("", "", tuple(labels)))   # labels at the end of the statement
    names = frozenset(regs)
    for i in out:
        i.names = names
    return out, regs


def _local(name: str) -> str:
    """The C++ variable of a register the statement declares (`%r` as CUTLASS writes it too)."""
    return "__l_" + name.replace("%", "pct_")


def _show(s: str) -> str:
    return re.sub(r"\0(\d+)\0", r"%\1", " ".join(s.split()))


def _operand(tok: str, names=frozenset()):
    tok = tok.strip()
    if tok.startswith("{"):
        if not tok.endswith("}"):
            raise _Error(f"cannot parse PTX register list `{_show(tok)}`")
        return ("list", [_operand(t, names) for t in tok[1:-1].split(",")])
    if tok.startswith("[") and "{" in tok:   # a tensor copy's [tensorMap, {c0, ...}]
        parts = _split_top(tok[1:-1] if tok.endswith("]") else "", ",")
        if len(parts) != 2 or not parts[1].strip().startswith("{"):
            raise _Error(f"cannot parse PTX tensor operand `{_show(tok)}`")
        return ("tensor", _operand(parts[0], names), _operand(parts[1], names))
    if tok.startswith("["):
        m = re.fullmatch(r"\[\s*(\0\d+\0|[A-Za-z_$][\w$]*)\s*(?:\+\s*(-?(?:0x[0-9a-fA-F]+|\d+)))?\s*\]", tok)
        if not m:
            raise _Error(f"cannot parse PTX address `{_show(tok)}`")
        return ("addr", _operand(m.group(1), names), int(m.group(2), 0) if m.group(2) else 0)
    m = re.fullmatch(r"\0(\d+)\0", tok)
    if m:
        return ("ref", int(m.group(1)))
    if re.fullmatch(r"-?(?:0[xX][0-9a-fA-F]+|\d+)[uU]?", tok):
        return ("imm", str(int(tok.rstrip("uU"), 0)))
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", tok):
        return ("imm", f"{int(tok[2:], 16)}u")   # a float's bits
    if "|" in tok:   # elect.sync's d|p
        a, _, b = tok.partition("|")
        return ("pair", _operand(a, names), _operand(b, names))
    if tok in names:
        return ("local", tok)
    if tok == "_":
        return ("sink",)
    raise _Error(f"inline PTX operand `{_show(tok)}` is not an asm operand, an immediate or a register the "
                 "statement declares (other PTX registers and special registers are not supported by the CPU emulator)")


# ---------------------------------------------------------------------------------------------
# instructions -> C++
_MMA = re.compile(r"mma\.sync\.aligned\.(m16n8k16|m16n8k8)\.row\.col\.f32\.(f16|bf16|tf32)\.(f16|bf16|tf32)\.f32")
_LDMATRIX = re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.(x1|x2|x4)(\.trans)?(\.shared(?:::cta)?)?\.b16")
_CP_ASYNC = re.compile(r"cp\.async\.(ca|cg)\.shared(?:::cta)?\.global(\.L2::cache_hint)?(?:\.L2::(?:64B|128B|256B))?")
# (A registers, B registers, minimum __CUDA_ARCH__) per (shape, type)
_MMA_FORMS = {("m16n8k16", "f16"): (4, 2, 800), ("m16n8k16", "bf16"): (4, 2, 800),
              ("m16n8k8", "f16"): (2, 1, 750), ("m16n8k8", "bf16"): (2, 1, 800), ("m16n8k8", "tf32"): (4, 2, 800)}
_TYPE_ENUM = {"f16": "EMU_MMA_F16", "bf16": "EMU_MMA_BF16", "tf32": "EMU_MMA_TF32"}
_SETP = re.compile(r"setp\.(eq|ne|lt|le|gt|ge)\.([bsu])(32|64)")
_SELP = re.compile(r"selp\.([bsu])(32|64)")
_BRA = re.compile(r"bra(\.uni)?")
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


class _Emitter(Sm90Instructions):
    """C++ for one asm statement: operand temporaries, one call per instruction, write-back."""

    def __init__(self, ops: list, site: Site, arch: Arch, regs: dict | None = None):
        self.ops, self.site, self.arch = ops, site, arch
        self.regs = regs or {}        # the statement's own registers: name -> PTX type
        self.calls = []
        self.labels = []
        self.byref = set()            # operands an instruction takes by address (no copy in or out)
        self.targets = set()          # labels a branch goes to

    def code(self) -> str:
        missing = self.targets - set(self.labels)
        if missing:
            raise _Error(f"`bra` to {', '.join(sorted(missing))}, which the statement does not define")
        # GCC's local labels keep two expansions of one statement in a function apart
        pre = [f"__label__ {', '.join(f'__L_{n}' for n in self.labels)};"] if self.labels else []
        pre += [f"{_REG_TYPES[t][0]} {_local(n)} = 0;" for n, t in self.regs.items()]
        post = []
        for op in self.ops:
            if op.index in self.byref:
                pre.append(f"auto&& __r{op.index} = ({op.expr});")
                continue
            ctype = _CONSTRAINTS[op.kind][0]
            if op.mode:
                pre.append(f"auto&& __r{op.index} = ({op.expr});")
                init = f"__emu_ptx_in<{ctype}>(__r{op.index})" if op.mode == "+" else f"{ctype}()"
                pre.append(f"{ctype} __p{op.index} = {init};")
                post.append(f"__emu_ptx_out(__r{op.index}, __p{op.index});")
            elif op.tied is not None:
                pre.append(f"__p{op.tied} = __emu_ptx_in<{ctype}>({op.expr});")
            else:
                pre.append(f"const {ctype} __p{op.index} = __emu_ptx_in<{ctype}>({op.expr});")
        return "do { " + " ".join(pre + self.calls + post) + " } while (0)"

    def fail(self, msg: str):
        raise _Error(msg)

    # -- operands
    def _var(self, ref: int) -> str:
        op = self.ops[ref]
        return f"__p{op.tied if op.tied is not None else ref}"

    def _reg(self, o, bits: int, what: str, out: bool = False) -> str:
        """C++ expression of a register operand of `bits` bits (raw bits for 32)."""
        if o[0] == "imm" and not out:
            return o[1]
        if o[0] == "local":
            have = _REG_TYPES[self.regs[o[1]]][1]
            if have != bits:
                raise _Error(f"{what}: register {o[1]} has {have} bit(s), the instruction needs {bits}")
            return _local(o[1])
        if o[0] != "ref":
            raise _Error(f"{what} must be a register operand")
        op = self.ops[o[1]]
        if _CONSTRAINTS[op.kind][1] != bits:
            raise _Error(f"{what}: operand %{o[1]} has constraint \"{op.kind}\" "
                         f"({_CONSTRAINTS[op.kind][1] or 'immediate'} bits), the instruction needs {bits} bits")
        if out and not (op.mode or op.tied is not None):
            raise _Error(f"{what}: operand %{o[1]} is an input but the instruction writes it")
        return f"__emu_ptx_bits({self._var(o[1])})" if bits == 32 and not out else self._var(o[1])

    def _list(self, o, n: int, what: str) -> list:
        if o[0] != "list" or len(o[1]) != n:
            raise _Error(f"{what} must be a list of {n} register(s) `{{...}}`")
        return o[1]

    def _imm(self, o, what: str) -> str:
        if o[0] == "imm":
            return o[1]
        if o[0] == "ref" and self.ops[o[1]].kind == "n":
            return f"(int){self._var(o[1])}"
        raise _Error(f"{what} must be an immediate (a literal or an \"n\" operand)")

    def _addr(self, o, what: str) -> str:
        if o[0] != "addr":
            raise _Error(f"{what} must be an address `[...]`")
        base = o[1]
        if base[0] == "ref" and self.ops[base[1]].kind in ("r", "l"):
            v = f"(uint64_t){self._var(base[1])}"
        elif base[0] == "imm":
            v = f"(uint64_t){base[1]}"
        else:
            raise _Error(f"{what}: the address register must be an \"r\" or \"l\" operand")
        return f"{v} + {o[2]}" if o[2] else v

    def _where(self) -> str:
        f = self.site.file.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{f}", {self.site.line}'

    def _need(self, opcode: str, cuda_arch: int):
        if self.arch.cuda_arch < cuda_arch:
            raise _Error(f"`{opcode}` needs sm_{cuda_arch // 10} or newer; the emulated architecture is "
                         f"{self.arch.name}, where ptxas rejects it too (pass RawModule(arch=...) or guard the "
                         "code with __CUDA_ARCH__)")

    def _count(self, instr: Instr, *n: int):
        if len(instr.operands) not in n:
            raise _Error(f"`{instr.opcode}` takes {' or '.join(map(str, n))} operands, got {len(instr.operands)}")

    def _pred(self, o, what: str, out: bool = False) -> str:
        """C++ expression of a predicate operand: a .pred register (or, read, 0 / 1)."""
        if o[0] == "imm" and not out and o[1] in ("0", "1"):
            return o[1]
        if o[0] != "local" or self.regs[o[1]] != "pred":
            raise _Error(f"{what} must be a .pred register the statement declares")
        return _local(o[1])

    # -- statements
    def statement(self, instr: Instr):
        for label in instr.labels:
            if label in self.labels:
                raise _Error(f"PTX label {label} is defined twice")
            self.labels.append(label)
            self.calls.append(f"__L_{label}:;")
        if not instr.opcode:
            return
        first = len(self.calls)
        self.instruction(instr)
        if instr.guard:
            name, negated = instr.guard
            body = " ".join(self.calls[first:])
            self.calls[first:] = [f"if ({'!' if negated else ''}{_local(name)}) {{ {body} }}"]

    # -- instructions
    def instruction(self, instr: Instr):
        op = instr.opcode
        for pattern, handler in ((_MMA, self._mma), (_LDMATRIX, self._ldmatrix), (_CP_ASYNC, self._cp_async),
                                 (_SETP, self._setp), (_SELP, self._selp), (_BRA, self._bra), *self.patterns()):
            m = pattern.fullmatch(op)
            if m:
                return handler(instr, m)
        simple = {"cp.async.commit_group": self._commit, "cp.async.wait_group": self._wait,
                  "cp.async.wait_all": self._wait_all, "cvt.rn.f16x2.f32": self._cvt_x2,
                  "cvt.rn.bf16x2.f32": self._cvt_x2, "cvt.rna.tf32.f32": self._cvt_tf32,
                  "ex2.approx.f32": self._ex2, "ex2.approx.ftz.f32": self._ex2}
        simple.update(self.simple())
        if op in simple:
            return simple[op](instr)
        raise _Error(f"inline PTX instruction `{op}` is not supported by the CPU emulator "
                     f"(it runs {SUPPORTED})")

    def _mma(self, instr: Instr, m):
        shape, ta, tb = m.group(1), m.group(2), m.group(3)
        form = _MMA_FORMS.get((shape, ta)) if ta == tb else None
        if form is None:
            raise _Error(f"inline PTX instruction `{instr.opcode}` is not supported by the CPU emulator "
                         f"(it runs {SUPPORTED})")
        na, nb, need = form
        self._need(instr.opcode, need)
        self._count(instr, 4)
        d, a, b, c = instr.operands
        dregs = [self._reg(o, 32, "mma.sync D", out=True) for o in self._list(d, 4, "mma.sync D")]
        aregs = [self._reg(o, 32, "mma.sync A") for o in self._list(a, na, "mma.sync A")]
        bregs = [self._reg(o, 32, "mma.sync B") for o in self._list(b, nb, "mma.sync B")]
        cregs = [self._reg(o, 32, "mma.sync C") for o in self._list(c, 4, "mma.sync C")]
        tc = self.arch.mma
        block = tc.block_k_tf32 if ta == "tf32" else tc.block_k_f16
        k = 16 if shape == "m16n8k16" else 8
        self.calls.append(
            f"{{ const uint32_t __a[4] = {{{', '.join(aregs)}}}; const uint32_t __b[2] = {{{', '.join(bregs)}}}; "
            f"const uint32_t __c[4] = {{{', '.join(cregs)}}}; uint32_t __d[4]; "
            f"__emu_ptx_mma({k}, {_TYPE_ENUM[ta]}, __a, __b, __c, __d, {block}, {tc.extra_bits}, {tc.min_exponent}, "
            f"{self._where()}); "
            + " ".join(f"__emu_ptx_set({r}, __d[{i}]);" for i, r in enumerate(dregs)) + " }")

    def _ldmatrix(self, instr: Instr, m):
        self._need(instr.opcode, 750)
        num = int(m.group(1)[1])
        self._count(instr, 2)
        d, addr = instr.operands
        dregs = [self._reg(o, 32, "ldmatrix destination", out=True) for o in self._list(d, num, "ldmatrix destination")]
        generic = 0 if m.group(3) else 1
        self.calls.append(
            f"{{ uint32_t __d[4]; __emu_ptx_ldmatrix({num}, {1 if m.group(2) else 0}, {generic}, "
            f"{self._addr(addr, 'ldmatrix address')}, __d, {self._where()}); "
            + " ".join(f"__emu_ptx_set({r}, __d[{i}]);" for i, r in enumerate(dregs)) + " }")

    def _cp_async(self, instr: Instr, m):
        self._need(instr.opcode, 800)
        hint = bool(m.group(2))
        self._count(instr, *((4, 5) if hint else (3, 4)))
        ops = instr.operands[:-1] if hint else instr.operands
        dst = self._addr(ops[0], "cp.async destination")
        src = self._addr(ops[1], "cp.async source")
        size = self._imm(ops[2], "cp.async cp-size")
        if ops[2][0] == "imm":
            allowed = ("16",) if m.group(1) == "cg" else ("4", "8", "16")
            if size not in allowed:
                raise _Error(f"`{instr.opcode}`: cp-size must be {' or '.join(allowed)}, got {size}")
        src_size = size
        if len(ops) == 4:
            o = ops[3]
            src_size = (self._imm(o, "cp.async src-size") if o[0] == "imm" or self.ops[o[1]].kind == "n"
                        else f"(int){self._reg(o, 32, 'cp.async src-size')}")
        self.calls.append(f"__emu_ptx_cp_async({dst}, {src}, {size}, {src_size}, {1 if m.group(1) == 'cg' else 0}, "
                          f"{self._where()});")

    def _commit(self, instr: Instr):
        self._need(instr.opcode, 800)
        self._count(instr, 0)
        self.calls.append("__emu_ptx_cp_async_commit();")

    def _wait(self, instr: Instr):
        self._need(instr.opcode, 800)
        self._count(instr, 1)
        self.calls.append(f"__emu_ptx_cp_async_wait({self._imm(instr.operands[0], 'cp.async.wait_group N')}, "
                          f"{self._where()});")

    def _wait_all(self, instr: Instr):
        self._need(instr.opcode, 800)
        self._count(instr, 0)
        # PTX: cp.async.wait_all is cp.async.commit_group followed by cp.async.wait_group 0
        self.calls.append(f"__emu_ptx_cp_async_commit(); __emu_ptx_cp_async_wait(0, {self._where()});")

    def _cvt_x2(self, instr: Instr):
        self._need(instr.opcode, 800)
        self._count(instr, 3)
        d, a, b = instr.operands
        fn = "__emu_ptx_cvt_rn_f16x2_f32" if ".f16x2" in instr.opcode else "__emu_ptx_cvt_rn_bf16x2_f32"
        self.calls.append(f"__emu_ptx_set({self._reg(d, 32, 'cvt destination', out=True)}, "
                          f"{fn}({self._reg(a, 32, 'cvt source')}, {self._reg(b, 32, 'cvt source')}));")

    def _cvt_tf32(self, instr: Instr):
        self._need(instr.opcode, 800)
        self._count(instr, 2)
        d, a = instr.operands
        self.calls.append(f"__emu_ptx_set({self._reg(d, 32, 'cvt destination', out=True)}, "
                          f"__emu_ptx_cvt_rna_tf32_f32({self._reg(a, 32, 'cvt source')}));")

    def _ex2(self, instr: Instr):
        self._count(instr, 2)
        d, a = instr.operands
        ftz = 1 if ".ftz" in instr.opcode else 0
        self.calls.append(f"__emu_ptx_set({self._reg(d, 32, 'ex2 destination', out=True)}, "
                          f"__emu_ptx_ex2_approx_f32({self._reg(a, 32, 'ex2 source')}, {ftz}));")

    def _setp(self, instr: Instr, m):
        cmp, kind, bits = m.group(1), m.group(2), int(m.group(3))
        if kind == "b" and cmp not in ("eq", "ne"):
            raise _Error(f"`{instr.opcode}`: .b{bits} compares only with eq or ne")
        self._count(instr, 3)
        p, a, b = instr.operands
        ctype = f"int{bits}_t" if kind == "s" else f"uint{bits}_t"
        self.calls.append(f"{self._pred(p, 'setp destination', out=True)} = ({ctype}){self._reg(a, bits, 'setp a')} "
                          f"{_CMP[cmp]} ({ctype}){self._reg(b, bits, 'setp b')};")

    def _selp(self, instr: Instr, m):
        bits = int(m.group(2))
        self._count(instr, 4)
        d, a, b, p = instr.operands
        self.calls.append(f"__emu_ptx_set({self._reg(d, bits, 'selp destination', out=True)}, "
                          f"{self._pred(p, 'selp predicate')} ? {self._reg(a, bits, 'selp a')} "
                          f": {self._reg(b, bits, 'selp b')});")

    def _bra(self, instr: Instr, m):
        target = instr.text.strip()
        if not re.fullmatch(r"[A-Za-z_$][\w$]*", target):
            raise _Error(f"`bra` needs a label of the statement, got `{_show(target)}`")
        self.targets.add(target)
        self.calls.append(f"goto __L_{target};")
