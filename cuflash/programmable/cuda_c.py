"""A call's score_mod and mask_mod as CUDA C, compiled into every attention kernel.

`kernel_mods` turns the translated mods (`translate.Mod`) into the text a kernel source
is compiled after (`KernelMods.code`): the captured arrays as extra kernel parameters
(`CUFLASH_MOD_PARAMS`, each a pointer of its own, so the emulator checks every read
against it, then its sizes and element strides), a record `cuflash_mods` built from them
(`CUFLASH_MOD_RECORD`, which kernels/variants.cuh stores in its Variants), and the
functions the score chain calls:

    A    cuflash_score_mod(A score, int b, int h, int q_idx, int kv_idx, const cuflash_mods&)
    A    cuflash_score_mod_grad(...)      ∂score_mod/∂score (forward mode), for the backward
    bool cuflash_mask_mod(int b, int h, int q_idx, int kv_idx, const cuflash_mods&)
    void cuflash_score_mod_vjp(..., A ds, add)   with `grads`: add(entry, ds·∂/∂entry) for
                                                 every read of a captured float array

With a block mask the record also holds the kinds of the launch's tiles (`tiles`), with
`grads` where the dQ kernels' warps add the gradients (`grad_part`, one row per warp).
Each tree node becomes one `const` line (a shared subtree, once), in the accumulation
type A for floats, `long long` for integers (as the NumPy backend's int64), `bool`.
Integer `//` and `%` floor as in Python; float `//` and `%` follow NumPy's divmod. An
index outside a captured array is clamped to its edge, except in the emulator's checked
mode (`clamp=False`), where the read itself is reported.
"""
import math
from typing import NamedTuple

import numpy as np

from .ir import BOOL, FLOAT, INT

# Functions of A: (float spelling, double spelling)
_MATH = {"exp": ("expf", "exp"), "exp2": ("exp2f", "exp2"), "expm1": ("expm1f", "expm1"),
         "log": ("logf", "log"), "log2": ("log2f", "log2"), "log10": ("log10f", "log10"),
         "log1p": ("log1pf", "log1p"), "sqrt": ("sqrtf", "sqrt"), "tanh": ("tanhf", "tanh"),
         "sinh": ("sinhf", "sinh"), "cosh": ("coshf", "cosh"), "sin": ("sinf", "sin"),
         "cos": ("cosf", "cos"), "tan": ("tanf", "tan"), "arctan": ("atanf", "atan"),
         "floor": ("floorf", "floor"), "ceil": ("ceilf", "ceil"), "trunc": ("truncf", "trunc"),
         "abs": ("fabsf", "fabs"), "pow": ("powf", "pow"), "fmod": ("fmodf", "fmod")}

# Helpers every generated specialization carries: the math functions for A = float and
# double, and Python's / NumPy's floor division and modulo, sign, min and max with NaN.
_PRELUDE = "\n".join(
    [f"__device__ __forceinline__ float cuflash_{n}(float x) {{ return {f}(x); }}\n"
     f"__device__ __forceinline__ double cuflash_{n}(double x) {{ return {d}(x); }}"
     for n, (f, d) in _MATH.items() if n not in ("pow", "fmod")]
    + ["__device__ __forceinline__ float cuflash_pow(float x, float y) { return powf(x, y); }",
       "__device__ __forceinline__ double cuflash_pow(double x, double y) { return pow(x, y); }",
       "__device__ __forceinline__ float cuflash_fmod(float x, float y) { return fmodf(x, y); }",
       "__device__ __forceinline__ double cuflash_fmod(double x, double y) { return fmod(x, y); }",
       """__device__ __forceinline__ long long cuflash_floordiv(long long a, long long b) {
    const long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long cuflash_mod(long long a, long long b) {
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <typename A> __device__ __forceinline__ A cuflash_fmodulo(A a, A b) {  // NumPy's a % b
    A r = cuflash_fmod(a, b);
    if (r != A(0)) { if ((b < A(0)) != (r < A(0))) r += b; } else r = (b < A(0)) ? -A(0) : A(0);
    return r;
}
template <typename A> __device__ __forceinline__ A cuflash_ffloordiv(A a, A b) {  // NumPy's a // b
    A r = cuflash_fmod(a, b);
    A d = (a - r) / b;
    if (r != A(0) && ((b < A(0)) != (r < A(0)))) d -= A(1);
    if (d != A(0)) { A f = cuflash_floor(d); if (d - f > A(0.5)) f += A(1); return f; }
    return (a / b < A(0)) ? -A(0) : A(0);
}
template <typename A> __device__ __forceinline__ A cuflash_minimum(A a, A b) {
    return (a != a) ? a : (b != b) ? b : (a <= b ? a : b);
}
template <typename A> __device__ __forceinline__ A cuflash_maximum(A a, A b) {
    return (a != a) ? a : (b != b) ? b : (a >= b ? a : b);
}
__device__ __forceinline__ long long cuflash_minimum(long long a, long long b) { return a <= b ? a : b; }
__device__ __forceinline__ long long cuflash_maximum(long long a, long long b) { return a >= b ? a : b; }
template <typename A> __device__ __forceinline__ A cuflash_sign(A x) {
    return (x > A(0)) ? A(1) : (x < A(0)) ? A(-1) : x;
}
__device__ __forceinline__ long long cuflash_sign(long long x) { return (x > 0) - (x < 0); }
__device__ __forceinline__ long long cuflash_ipow(long long x, long long n) {
    long long r = 1;
    for (; n > 0; --n) r *= x;
    return r;
}
__device__ __forceinline__ long long cuflash_index(long long i, long long n, bool clamp) {
    return clamp ? (i < 0 ? 0 : (i >= n ? n - 1 : i)) : i;
}"""])

# Buffers as the kernels read them: floats in the accumulation type, integers as
# long long, booleans as bytes (converted on the host where the dtype differs).
_C_TYPES = {"f4": "float", "f8": "double", "i8": "long long", "u1": "unsigned char"}


class KernelMods(NamedTuple):
    """What a kernel compiles and launches with for one call's mods: `code` (compiled
    before the kernel's source), `key` (its cache key), `buffers` ((name, array) in
    parameter order, already in the kernels' dtypes), `flags` (the Variants bits),
    `block_mask` (whether the record holds a block mask's tile kinds) and `grad_spans`
    ((name, offset, size) of each score_mod float array's gradient in a partial; empty
    without gradients)."""

    code: str
    key: str
    buffers: tuple
    flags: int
    block_mask: bool = False
    grad_spans: tuple = ()


def kernel_mods(xp, score_mod, mask_mod, acc_t, *, clamp=True, block_mask=False,
                grads=False):
    """The KernelMods of a call (score_mod, mask_mod: translate.Mod or None) for the
    accumulation dtype acc_t, on the array module xp (buffers converted there). With
    `block_mask` the record also holds a block mask's tile kinds (CUFLASH_BLOCK_MASK:
    mod_args' `tiles`); with `grads`, where the score_mod's captured float arrays'
    gradients go (CUFLASH_MOD_GRADS: cuflash_score_mod_vjp, mod_args' `grad_part`)."""
    acc_t = np.dtype(acc_t)
    A = "float" if acc_t == np.float32 else "double"
    buffers = {}
    for mod in (score_mod, mask_mod):
        for name, arr in (mod.buffers.items() if mod is not None else ()):
            if name in buffers and buffers[name] is not arr:
                raise ValueError(f"score_mod and mask_mod capture two different arrays under "
                                 f"the name `{name}`; rename one")
            buffers[name] = arr
    converted = []
    for name, arr in buffers.items():
        kind = np.dtype(arr.dtype).kind
        want = acc_t if kind not in "iub" else (np.dtype(np.uint8) if kind == "b"
                                                 else np.dtype(np.int64))
        a = xp.asarray(arr)
        a = a.view(np.uint8) if kind == "b" else a.astype(want, copy=False)
        converted.append((name, a))
    lines = ["// programmable attention: generated from the call's score_mod / mask_mod",
             '#include "common.cuh"', _PRELUDE, "struct cuflash_mods {"]
    params, record = [], []
    for name, a in converted:
        ct = _C_TYPES[a.dtype.str[1:]]
        lines.append(f"    const {ct}* {name};")
        lines += [f"    long long {name}_n{i}, {name}_s{i};" for i in range(a.ndim)]
        params.append(f"const {ct}* mod_{name}")
        params += [f"long long mod_{name}_n{i}, long long mod_{name}_s{i}" for i in range(a.ndim)]
        record.append(f"mod_{name}")
        record += [f"mod_{name}_n{i}, mod_{name}_s{i}" for i in range(a.ndim)]
    grad_spans = []  # (name, offset, size) of each float array's gradient in a partial
    if grads:
        for name in score_mod.float_buffers():
            size = int(np.prod(score_mod.buffers[name].shape, dtype=np.int64))
            grad_spans.append((name, sum(n for *_, n in grad_spans), size))
        lines += [f"    long long {name}_goff;" for name, *_ in grad_spans]
        lines.append(f"    {A}* grad_part;")
        lines.append("    long long grad_stride;")
        params += [f"long long mod_{name}_goff" for name, *_ in grad_spans]
        params.append(f"{A}* mod_grad_part, long long mod_grad_stride")
        record += [f"mod_{name}_goff" for name, *_ in grad_spans]
        record.append("mod_grad_part, mod_grad_stride")
    if block_mask:  # the kinds of the kernel's tiles, (b, h, tile row, tile column)
        lines.append("    const unsigned char* tile_kinds;")
        lines.append("    long long tiles_sb, tiles_sh, tiles_k;")
        params.append("const unsigned char* mod_tile_kinds, long long mod_tiles_sb, "
                      "long long mod_tiles_sh, long long mod_tiles_k")
        record.append("mod_tile_kinds, mod_tiles_sb, mod_tiles_sh, mod_tiles_k")
    if not record:
        lines.append("    int unused;")
        record.append("0")
    lines.append("};")
    emit = _Emitter(A, clamp, dict(converted))
    flags = 0
    if score_mod is not None:
        flags |= SCORE_MOD
        lines.append(emit.function(score_mod.expr, "cuflash_score_mod", A,
                                   f"{A} score, int b, int h, int q_idx, int kv_idx"))
        lines.append(emit.function(score_mod.expr, "cuflash_score_mod_grad", A,
                                   f"{A} score, int b, int h, int q_idx, int kv_idx",
                                   grad=True))
        lines.append("#define CUFLASH_SCORE_MOD 1")
        if grads:
            lines.append(emit.vjp(score_mod.expr, f"{A} score, int b, int h, int q_idx, "
                                                  f"int kv_idx"))
            lines.append("#define CUFLASH_MOD_GRADS 1")
    if mask_mod is not None:
        flags |= MASK_MOD
        lines.append(emit.function(mask_mod.expr, "cuflash_mask_mod", "bool",
                                   "int b, int h, int q_idx, int kv_idx"))
        lines.append("#define CUFLASH_MASK_MOD 1")
    if block_mask:
        lines.append("#define CUFLASH_BLOCK_MASK 1")
    lines.append("#define CUFLASH_MODS 1")
    lines.append("#define CUFLASH_MOD_PARAMS , " + ", ".join(params) if params else
                 "#define CUFLASH_MOD_PARAMS")
    lines.append("#define CUFLASH_MOD_RECORD , cuflash_mods{" + ", ".join(record) + "}")
    code = "\n".join(lines) + "\n"
    key = "|".join([A, str(clamp), "block_mask" * block_mask, "grads" * grads]
                   + [m.key() for m in (score_mod, mask_mod) if m is not None])
    return KernelMods(code, key, tuple(converted), flags, block_mask, tuple(grad_spans))


def mod_args(mods, tiles=None, grad_part=None):
    """The CUFLASH_MOD_PARAMS arguments of a launch, in order. `tiles`: the block mask's
    kinds of the launch's tiles (BlockMask.kernel_tiles), where mods were made with one;
    `grad_part`: the (warps, Σ sizes) partials the launch's warps add the gradients into,
    where mods were made with grad_spans (a 1-element dummy for a launch that adds none)."""
    out = []
    for _, a in mods.buffers:
        out.append(a)
        for n, s in zip(a.shape, a.strides):
            out += [np.int64(n), np.int64(s // a.itemsize)]
    if mods.grad_spans:  # (a launch that adds none passes a 1-element dummy)
        out += [np.int64(off) for _, off, _ in mods.grad_spans]
        out += [grad_part, np.int64(grad_part.shape[-1] if grad_part.ndim == 2 else 0)]
    if mods.block_mask:  # C-contiguous bytes: strides in elements; 0 along a broadcast axis
        out += [tiles, *(np.int64(0 if n == 1 else s) for n, s in zip(tiles.shape[:2],
                                                                       tiles.strides[:2])),
                np.int64(tiles.shape[3])]
    return tuple(out)


# Bits of VariantFlag (kernels/variants.cuh).
SCORE_MOD, MASK_MOD = 64, 128


class _Emitter:
    def __init__(self, A, clamp, buffers):
        self.A, self.clamp, self.buffers = A, clamp, buffers

    def ctype(self, kind):
        return {FLOAT: self.A, INT: "long long", BOOL: "bool"}[kind]

    def function(self, expr, name, ret, params, grad=False):
        """One __device__ function computing expr (with grad: its derivative with
        respect to `score`, by forward mode: each float node carries its derivative)."""
        body, names, dnames = [], {}, {}
        for i, n in enumerate(expr.walk()):
            v = f"v{i}"
            body.append(f"    const {self.ctype(n.kind)} {v} = {self.value(n, names)};")
            names[id(n)] = v
            if grad and n.kind == FLOAT:
                body.append(f"    const {self.A} d{v} = {self.derivative(n, names, dnames)};")
                dnames[id(n)] = f"d{v}"
        result = dnames[id(expr)] if grad else names[id(expr)]
        return (f"__device__ __forceinline__ {ret} {name}({params}, const cuflash_mods& mods) {{\n"
                + "\n".join(body) + f"\n    return {result};\n}}")

    def vjp(self, expr, params):
        """cuflash_score_mod_vjp(..., ds, add): for each read of a captured float array,
        add(entry, ds·∂expr/∂entry), entry its row-major index plus the array's offset
        in the partial (mods.X_goff). Each derivative by forward mode seeded at the read;
        every call of add happens on every path (a warp's lanes call it together)."""
        body, names = [], {}
        order = list(expr.walk())
        for i, n in enumerate(order):
            body.append(f"    const {self.ctype(n.kind)} v{i} = {self.value(n, names)};")
            names[id(n)] = f"v{i}"
        A = self.A
        for r, read in enumerate(order):
            if read.op != "index" or read.kind != FLOAT:
                continue
            d = {id(read): f"{A}(1)"}
            for i, n in enumerate(order[r + 1:], r + 1):
                if n.kind == FLOAT and n.op not in ("arg", "const", "index") and any(
                        id(x) in d for x in n.args):
                    body.append(f"    const {A} e{r}_{i} = {self.derivative(n, names, d)};")
                    d[id(n)] = f"e{r}_{i}"
            if id(expr) not in d:
                continue  # this read does not reach the result
            idx = [names[id(x)] for x in read.args]
            x = read.value
            flat = f"cuflash_index({idx[0]}, mods.{x}_n0, {str(self.clamp).lower()})"
            for k, ik in enumerate(idx[1:], 1):
                flat = (f"({flat} * mods.{x}_n{k} + "
                        f"cuflash_index({ik}, mods.{x}_n{k}, {str(self.clamp).lower()}))")
            g = d[id(expr)]
            body.append(f"    add(mods.{x}_goff + {flat}, ds == {A}(0) ? {A}(0) : ds * {g});")
        return (f"template <class Add>\n__device__ __forceinline__ void cuflash_score_mod_vjp("
                f"{params}, const cuflash_mods& mods, {A} ds, const Add& add) {{\n"
                + "\n".join(body) + "\n}")

    def literal(self, n):
        if n.kind == BOOL:
            return "true" if n.value else "false"
        if n.kind == INT:
            return f"{n.value}LL"
        v = n.value
        if math.isnan(v):
            return f"(cuflash::neg_inf<{self.A}>() * {self.A}(0))"
        if math.isinf(v):
            return f"({'' if v < 0 else '-'}cuflash::neg_inf<{self.A}>())"
        return f"{self.A}({float(v).hex()})"

    def value(self, n, names):
        a = [names[id(x)] for x in n.args]
        op, A = n.op, self.A
        if op == "const":
            return self.literal(n)
        if op == "arg":
            return "score" if n.value == "score" else f"(long long){n.value}"
        if op == "cast":
            src = n.args[0].kind
            if n.kind == BOOL:
                return f"({a[0]} != 0)"
            return f"({self.ctype(n.kind)})({a[0]})" if src != n.kind else a[0]
        simple = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=",
                  "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "lshift": "<<",
                  "rshift": ">>"}
        if op in simple:
            return f"({a[0]} {simple[op]} {a[1]})"
        if op in ("and", "or", "xor"):
            sym = ({"and": "&&", "or": "||", "xor": "!="} if n.kind == BOOL
                   else {"and": "&", "or": "|", "xor": "^"})[op]
            return f"({a[0]} {sym} {a[1]})"
        if op == "neg":
            return f"(-{a[0]})"
        if op == "invert":
            return f"(!{a[0]})" if n.kind == BOOL else f"(~{a[0]})"
        if op == "floordiv":
            return (f"cuflash_floordiv({a[0]}, {a[1]})" if n.kind == INT
                    else f"cuflash_ffloordiv<{A}>({a[0]}, {a[1]})")
        if op == "mod":
            return (f"cuflash_mod({a[0]}, {a[1]})" if n.kind == INT
                    else f"cuflash_fmodulo<{A}>({a[0]}, {a[1]})")
        if op == "pow":
            return (f"cuflash_ipow({a[0]}, {a[1]})" if n.kind == INT
                    else f"cuflash_pow({a[0]}, {a[1]})")
        if op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op == "index":
            buf = self.buffers[n.value]
            terms = [f"cuflash_index({i}, mods.{n.value}_n{k}, {str(self.clamp).lower()}) * "
                     f"mods.{n.value}_s{k}" for k, i in enumerate(a)]
            read = f"mods.{n.value}[{' + '.join(terms)}]"
            return f"({self.ctype(n.kind)})({read})" if buf.dtype.kind == "u" else read
        if op == "call":
            f = n.value
            if f == "abs" and n.kind == INT:
                return f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
            if f == "square":
                return f"({a[0]} * {a[0]})"
            if f in ("minimum", "maximum", "sign"):
                t = f"<{A}>" if n.kind == FLOAT else ""
                return f"cuflash_{f}{t}({', '.join(a)})"
            if f == "clip":
                t = f"<{A}>" if n.kind == FLOAT else ""
                return f"cuflash_minimum{t}(cuflash_maximum{t}({a[0]}, {a[1]}), {a[2]})"
            return f"cuflash_{f}({a[0]})"
        raise AssertionError(f"unknown operation {op}")  # pragma: no cover

    def derivative(self, n, names, d):
        """∂n/∂score as C, from the arguments' values (names) and derivatives (d)."""
        A = self.A
        zero = f"{A}(0)"
        da = [d.get(id(x), zero) for x in n.args]
        a = [names[id(x)] for x in n.args]
        y = names[id(n)]
        op = n.op
        if op == "arg":
            return f"{A}(1)"
        if op in ("const", "index", "floordiv"):
            return zero
        if op == "cast":
            return da[0]
        if op == "neg":
            return f"(-{da[0]})"
        if op in ("add", "sub"):
            return f"({da[0]} {'+' if op == 'add' else '-'} {da[1]})"
        if op == "mul":
            return f"({da[0]} * {a[1]} + {a[0]} * {da[1]})"
        if op == "div":
            return f"(({da[0]} - {y} * {da[1]}) / {a[1]})"
        if op == "mod":
            return f"({da[0]} - {da[1]} * cuflash_ffloordiv<{A}>({a[0]}, {a[1]}))"
        if op == "pow":
            out = f"{da[0]} * {a[1]} * cuflash_pow({a[0]}, {a[1]} - {A}(1))"
            if n.args[1].op != "const":
                out += f" + ({da[1]} == {A}(0) ? {A}(0) : {da[1]} * {y} * cuflash_log({a[0]}))"
            return f"({out})"
        if op == "where":
            return f"({a[0]} ? {da[1]} : {da[2]})"
        if op != "call":
            return zero  # pragma: no cover - no other float operation
        f, x = n.value, a[0]
        if f in ("minimum", "maximum"):
            cmp = "<=" if f == "minimum" else ">="
            return f"({a[0]} {cmp} {a[1]} ? {da[0]} : {da[1]})"
        if f == "clip":
            return (f"({a[0]} < {a[1]} ? {da[1]} : ({a[0]} > {a[2]} ? {da[2]} : {da[0]}))")
        rule = {"exp": f"{y}", "exp2": f"{y} * {A}({math.log(2).hex()})", "expm1": f"({y} + {A}(1))",
                "log": f"({A}(1) / {x})", "log2": f"({A}(1) / ({x} * {A}({math.log(2).hex()})))",
                "log10": f"({A}(1) / ({x} * {A}({math.log(10).hex()})))",
                "log1p": f"({A}(1) / ({A}(1) + {x}))", "sqrt": f"({A}(0.5) / {y})",
                "tanh": f"({A}(1) - {y} * {y})", "sinh": f"cuflash_cosh({x})",
                "cosh": f"cuflash_sinh({x})", "sin": f"cuflash_cos({x})",
                "cos": f"(-cuflash_sin({x}))", "tan": f"({A}(1) + {y} * {y})",
                "arctan": f"({A}(1) / ({A}(1) + {x} * {x}))", "abs": f"cuflash_sign<{A}>({x})",
                "square": f"({A}(2) * {x})"}.get(f)
        if rule is None:  # floor, ceil, trunc, sign: flat
            return zero
        return f"({da[0]} * {rule})"
