"""The static cost of a kernel's main loop, read from its SASS (an `nvdisasm` listing).

One function of the listing → basic blocks → control-flow graph → natural loops (a back
edge u → h where h dominates u; the loop is h and every block that reaches u without
passing h). The main loop is the natural loop holding the most HMMA (HGMMA). One
steady-state iteration is the cheapest path from the loop's head to a back edge that
passes every block of the loop holding an HMMA, a tile copy (LDGSTS, UTMALDG) or a
global reduction (RED, ATOM: the 5-GEMM backward's dQ partials): optional work (masking,
variants, the last tile's missing copy) is left out, while predicated
instructions count, since they take an issue slot whether or not they execute. An inner
loop's blocks are entered once on that path, so work left in a rolled inner loop is
under-counted: `exp2_needed` states what the softmax must show.

The path's instructions are counted by class (`CLASSES`), its mma work in HMMA.16816 units
(`mma_work`: an HGMMA is a warpgroup's N·K/128 of them per warp); `LoopCost` holds the
figures.
"""
from __future__ import annotations

import dataclasses
import re

# Instruction classes, in the order tables print them.
CLASSES = ("HMMA", "LDSM", "LDGSTS", "MUFU.EX2", "MUFU", "FP32", "conversion", "SHFL",
           "int/addr", "move", "uniform", "branch/barrier", "LDS/STS", "LDG/STG", "LDL/STL",
           "other")

_BY_ROOT = {
    **dict.fromkeys(("HMMA", "HGMMA"), "HMMA"),
    "LDSM": "LDSM",
    **dict.fromkeys(("LDGSTS", "UTMALDG"), "LDGSTS"),
    **dict.fromkeys(("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSET", "FSETP", "FCHK",
                     "FSWZADD", "HADD2", "HFMA2", "HMUL2", "HMNMX2", "HSET2", "HSETP2"),
                    "FP32"),
    **dict.fromkeys(("F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "FRND"), "conversion"),
    "SHFL": "SHFL",
    **dict.fromkeys(("IMAD", "IADD3", "IADD", "IMUL", "LEA", "LOP3", "LOP", "SHF", "SHL",
                     "SHR", "ISETP", "IMNMX", "SEL", "IABS", "PRMT", "PLOP3", "P2R", "R2P",
                     "BMSK", "SGXT", "POPC", "FLO", "BREV", "IDP", "ISCADD", "VIADD",
                     "VIADDMNMX", "VIMNMX", "BFE", "BFI"), "int/addr"),
    **dict.fromkeys(("MOV", "CS2R", "S2R", "MOVM"), "move"),
    **dict.fromkeys(("R2UR", "S2UR", "REDUX", "VOTEU"), "uniform"),
    **dict.fromkeys(("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC",
                     "BREAK", "BMOV", "WARPSYNC", "BAR", "DEPBAR", "LDGDEPBAR", "YIELD",
                     "WARPGROUP", "MEMBAR", "SYNCS", "ARRIVES", "NANOSLEEP", "BPT", "KILL",
                     "ERRBAR"), "branch/barrier"),
    **dict.fromkeys(("LDS", "STS", "ATOMS"), "LDS/STS"),
    **dict.fromkeys(("LDG", "STG", "LD", "ST", "RED", "REDG", "ATOM", "ATOMG", "UBLKRED"),
                    "LDG/STG"),
    **dict.fromkeys(("LDL", "STL"), "LDL/STL"),
}


def classify(opcode: str) -> str:
    """The class (one of `CLASSES`) of a SASS opcode with its modifiers ("IMAD.MOV.U32")."""
    root = opcode.split(".", 1)[0]
    if root == "MUFU":
        return "MUFU.EX2" if opcode.startswith("MUFU.EX2") else "MUFU"
    # IMAD.MOV is how ptxas spells a register move on the integer FMA pipe: no arithmetic
    if opcode.startswith("IMAD.MOV"):
        return "move"
    if root in _BY_ROOT:
        return _BY_ROOT[root]
    return "uniform" if root.startswith("U") else "other"


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str       # the guard: "" (none), "P0", "!P0", "PT", "!UP1", ...
    opcode: str          # with modifiers: "HMMA.16816.F32"
    target: str | None   # the label a jump goes to
    condition: str = ""  # a branch's predicate operand: `BRA.U !UP0, target`

    @property
    def root(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def jump(self) -> bool:
        return self.root in _BRANCHES or self.target is not None

    @property
    def conditional(self) -> bool:
        return any(p not in _TRUE for p in (self.predicate, self.condition))

    @property
    def never(self) -> bool:
        return any(p in _FALSE for p in (self.predicate, self.condition))


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """One steady-state iteration of the main loop (per warp instruction stream)."""

    found: bool          # whether the function has a loop holding an HMMA
    loop_blocks: int     # basic blocks of the main loop
    path_blocks: int     # basic blocks on the iteration's path
    total: int           # instructions on the path
    counts: dict         # {class: instructions} over CLASSES
    mma_work: int = 0    # the path's HMMA, an HGMMA counted as the HMMA.16816 it equals

    @property
    def hmma(self) -> int:
        """HMMA of the iteration, in HMMA.16816 units where it holds HGMMA (`mma_work`)."""
        return self.mma_work or self.counts.get("HMMA", 0)

    @property
    def mufu_ex2(self) -> int:
        return self.counts.get("MUFU.EX2", 0)

    @property
    def per_hmma(self) -> float | None:
        """Instructions per HMMA (None without one)."""
        return self.total / self.hmma if self.hmma else None


NO_LOOP = LoopCost(False, 0, 0, 0, dict.fromkeys(CLASSES, 0))

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L\w+|\$[\w$.]+):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
_CONDITION = re.compile(r"^\s*(!?U?P(?:T|\d+))\s*,")
_TRUE, _FALSE = ("", "PT", "UPT"), ("!PT", "!UPT")
_BRANCHES = ("BRA", "JMP")
_ENDS = ("EXIT", "RET", "BRX", "JMX")   # no successor known from the listing


def parse_function(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of one function's listing and its labels ({label: address})."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        address, predicate, opcode, operands = m.groups()
        address = int(address, 16)
        for name in pending:
            labels[name] = address
        pending = []
        root = opcode.split(".", 1)[0]
        t = _TARGET.search(operands) if root in (*_BRANCHES, "CALL") else None
        target = t.group(1) if t else None
        # ptxas leaves some loops by a CALL.REL.NOINC to a local label, which never returns:
        # a jump. A call to a subroutine (`$...`, e.g. a division's slow path) returns.
        if root == "CALL" and not (target or "").startswith(".L"):
            target = None
        c = _CONDITION.match(operands) if target else None
        instructions.append(Instruction(address, predicate or "", opcode, target,
                                        c.group(1) if c else ""))
    return instructions, labels


@dataclasses.dataclass
class Block:
    instructions: list
    successors: list = dataclasses.field(default_factory=list)


def basic_blocks(instructions: list[Instruction], labels: dict[str, int]) -> list[Block]:
    """The function's basic blocks, block 0 the entry, with their successors (indices).
    A predicated jump has both edges; EXIT, RET and indirect jumps end a path (a predicated
    one falls through too); an unconditional branch to itself is the padding after the
    function's end."""
    if not instructions:
        return []
    index = {ins.address: i for i, ins in enumerate(instructions)}
    dest = {i: index.get(labels.get(ins.target)) for i, ins in enumerate(instructions)
            if ins.jump and not ins.never}
    leaders = {0, *(d for d in dest.values() if d is not None)}
    leaders.update(i + 1 for i, ins in enumerate(instructions)
                   if i in dest or ins.root in _ENDS)
    starts = sorted(x for x in leaders if x < len(instructions))
    block_of = {x: n for n, x in enumerate(starts)}
    ends = starts[1:] + [len(instructions)]
    blocks = [Block(instructions[x:e]) for x, e in zip(starts, ends)]
    for n, (blk, e) in enumerate(zip(blocks, ends)):
        i, last = e - 1, blk.instructions[-1]
        if i in dest and dest[i] is not None and not (dest[i] == i and not last.conditional):
            blk.successors.append(block_of[dest[i]])
        ends_path = (i in dest or last.root in _ENDS) and not last.never
        if e < len(instructions) and (last.conditional or not ends_path) \
                and n + 1 not in blk.successors:
            blk.successors.append(n + 1)
    return blocks


def _reverse_postorder(blocks):
    seen, order = {0}, []
    stack = [(0, iter(blocks[0].successors))]
    while stack:
        node, it = stack[-1]
        nxt = next((s for s in it if s not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(blocks[nxt].successors)))
    return order[::-1]


def dominators(blocks: list[Block]) -> dict[int, int]:
    """{block: immediate dominator} of the blocks reachable from the entry (Cooper,
    Harvey and Kennedy's iteration over reverse postorder); the entry maps to itself."""
    rpo = _reverse_postorder(blocks)
    number = {b: i for i, b in enumerate(rpo)}
    preds = {b: [] for b in rpo}
    for b in rpo:
        for s in blocks[b].successors:
            preds[s].append(b)
    idom = {0: 0}

    def meet(a, b):
        while a != b:
            while number[a] > number[b]:
                a = idom[a]
            while number[b] > number[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            done = [p for p in preds[b] if p in idom]
            new = done[0]
            for p in done[1:]:
                new = meet(p, new)
            if idom.get(b) != new:
                idom[b] = new
                changed = True
    return idom


def _dominates(idom, a, b):
    while b != a:
        if b == 0:
            return a == 0
        b = idom[b]
    return True


def natural_loops(blocks: list[Block]) -> dict[int, set[int]]:
    """{head: blocks of its natural loop}, the loops of back edges to one head merged."""
    idom = dominators(blocks)
    preds = {b: [] for b in idom}
    for b in idom:
        for s in blocks[b].successors:
            preds[s].append(b)
    loops = {}
    for u in idom:
        for h in blocks[u].successors:
            if _dominates(idom, h, u):
                body = loops.setdefault(h, {h})
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in body:
                        body.add(x)
                        stack.extend(preds[x])
    return loops


def _is_mma(ins):
    return ins.root in ("HMMA", "HGMMA")


_HGMMA_SHAPE = re.compile(r"HGMMA\.64x(\d+)x(\d+)")


def mma_work(opcode: str) -> int:
    """An mma instruction's work in HMMA.16816 units, per warp: HMMA 1 (each is counted as
    one, m16n8k8 included); HGMMA.64xNxK (a warpgroup's; each of its 4 warps issues it for
    16 of the 64 rows) 16·N·K / (16·8·16) = N·K / 128."""
    m = _HGMMA_SHAPE.match(opcode)
    return int(m.group(1)) * int(m.group(2)) // 128 if m else 1


def _is_tile_io(ins):
    return ins.root in ("LDGSTS", "UTMALDG", "RED", "REDG", "ATOM", "ATOMG", "UBLKRED")


def main_loop(blocks: list[Block]) -> tuple[int, set[int]] | None:
    """(head, blocks) of the natural loop holding the most HMMA, or None where no loop holds
    one. A loop around a main loop, one holding another loop with HMMA and a barrier (a
    BAR, or an mbarrier's SYNCS; e.g. over a worker's key blocks or a persistent block's
    tiles), holds more but is not one; a rolled loop of products without a barrier inside
    the main loop does not disqualify it."""
    loops = natural_loops(blocks)

    def count(body, pred):
        return sum(pred(i) for b in body for i in blocks[b].instructions)

    tiled = {h for h, body in loops.items()
             if count(body, _is_mma) and count(body, lambda i: i.root in ("BAR", "SYNCS"))}
    best, key = None, (0, 0)
    for head, body in loops.items():
        n = count(body, _is_mma)
        if any(o != head and o in body for o in tiled):
            continue
        if (n, -len(body)) > key:
            best, key = (head, body), (n, -len(body))
    return best


def steady_state_path(blocks: list[Block], head: int, body: set[int]) -> list[int]:
    """The blocks of one steady-state iteration of the loop (head, body): of the paths from
    the head to a back edge, with the back edges of inner loops cut (their blocks entered
    once), the one passing the most HMMA, tile copies and global reductions, then the
    fewest inner loops (a rolled loop on a side path, such as the variants' chain, is not
    the steady state), then the fewest instructions."""
    # depth-first from the head within the body: the retreating edges are the back edges
    # (of this loop and of inner ones), the rest is a DAG whose postorder reversed sorts it
    order, seen, retreat, on_stack = [], {head}, set(), {head}
    stack = [(head, iter(blocks[head].successors))]
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(node)
            on_stack.discard(node)
            stack.pop()
        elif nxt in body:
            if nxt in on_stack:
                retreat.add((node, nxt))
            elif nxt not in seen:
                seen.add(nxt)
                on_stack.add(nxt)
                stack.append((nxt, iter(blocks[nxt].successors)))
    inner = {s for _, s in retreat if s != head}   # inner loops' heads
    weight = {b: (sum(_is_mma(i) or _is_tile_io(i) for i in blocks[b].instructions),
                  -(b in inner), -len(blocks[b].instructions)) for b in seen}
    best = {head: (weight[head], [head])}   # lexicographic: (work, −loops, −instructions)
    for b in reversed(order):
        if b not in best:
            continue
        (w, n, c), path = best[b]
        for s in blocks[b].successors:
            if s in body and (b, s) not in retreat:
                cand = ((w + weight[s][0], n + weight[s][1], c + weight[s][2]), path + [s])
                if s not in best or cand[0] > best[s][0]:
                    best[s] = cand
    latches = [b for b in best if head in blocks[b].successors]
    return max((best[b] for b in latches), key=lambda x: x[0])[1]


def loop_cost(text: str) -> LoopCost:
    """The cost of one steady-state iteration of the main loop of one function's listing
    (`nvdisasm` output, the function's section alone); `NO_LOOP` where no loop holds an
    HMMA."""
    blocks = basic_blocks(*parse_function(text))
    loop = main_loop(blocks) if blocks else None
    if loop is None:
        return NO_LOOP
    head, body = loop
    path = steady_state_path(blocks, head, body)
    counts = dict.fromkeys(CLASSES, 0)
    work = 0
    for b in path:
        for ins in blocks[b].instructions:
            counts[classify(ins.opcode)] += 1
            work += mma_work(ins.opcode) if _is_mma(ins) else 0
    return LoopCost(True, len(body), len(path), sum(counts.values()), counts, work)


def exp2_needed(plan) -> int:
    """The MUFU.EX2 one steady-state iteration of a tensor-core plan's main loop must issue
    per warp: one per score of its tile (the forward's P̃ = exp2(S − m); the backward
    recomputes P = exp2(S − lse) in both its kernels), each thread owning an equal share:
    block_m·block_n (backward: block_rows·tile_rows) / threads."""
    rows, cols = ((plan.block_m, plan.block_n) if hasattr(plan, "block_m")
                  else (plan.block_rows, plan.tile_rows))
    return rows * cols // plan.num_threads
