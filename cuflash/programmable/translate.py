"""Python score_mod / mask_mod functions read into one expression tree (`ir.Node`).

The function's source is parsed (`ast`), its names resolved against its closure and
globals, helper functions inlined and local assignments substituted, so what comes out
is one expression of the arguments (score, b, h, q_idx, kv_idx), constants and the
arrays the function captures. Anything outside the subset (docs/programmable.md) is a
TypeError naming the function, the line and what is allowed; a captured array that
cannot be read is a ValueError.
"""
import ast
import inspect
import math
import textwrap
import types
from typing import NamedTuple

import numpy as np

from .ir import (ARG_KINDS, ARGS, BOOL, FLOAT, FLOAT_FUNCS, INT, KIND_FUNCS, Node)

ALLOWED = ("arithmetic (+ - * / // % **), comparisons, & | ^ ~ << >> on booleans and "
           "integers, `and`/`or`/`not` on booleans, `x if c else y`, abs/min/max/int/"
           "float/bool, NumPy's elementwise functions (np.exp, np.log, np.tanh, np.sqrt, "
           "np.where, np.minimum, np.maximum, ...), calls of other such functions, "
           "local assignments, and integer indexing of captured arrays")

_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div",
           ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.Pow: "pow", ast.BitAnd: "and",
           ast.BitOr: "or", ast.BitXor: "xor", ast.LShift: "lshift", ast.RShift: "rshift"}
_COMPARE = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq",
            ast.NotEq: "ne"}
# Other spellings of the same elementwise functions (NumPy's absolute, math's atan).
_ALIASES = {"absolute": "abs", "atan": "arctan"}
_CASTS = {"int": INT, "int32": INT, "int64": INT, "float": FLOAT, "float32": FLOAT,
          "float64": FLOAT, "bool": BOOL, "bool_": BOOL}
_CONSTANTS = {"pi": math.pi, "e": math.e, "inf": math.inf}
_MAX_DEPTH = 32  # nested helper calls: deeper is recursion
ORIGIN = "cuflash_origin"  # the captured offsets of a part's mod (Mod.at)


class Mod(NamedTuple):
    """A translated score_mod or mask_mod: the expression and the captured arrays by the
    names the functions use (`buffers`), plus what error messages call it."""

    role: str            # "score_mod" or "mask_mod"
    name: str            # the function's qualified name
    expr: Node
    buffers: dict        # name → the captured array, as captured

    def key(self):
        """The specialization's cache key: the expression and the buffers' dtypes and
        dimensions (not their values, which are read at run time)."""
        bufs = ",".join(f"{n}:{np.dtype(a.dtype).str}:{a.ndim}"
                        for n, a in sorted(self.buffers.items()))
        return f"{self.role}[{bufs}]{self.expr.key()}"

    def float_buffers(self):
        """The names of the captured float arrays: the ones with a gradient."""
        return tuple(n for n, a in self.buffers.items() if _kind_of_dtype(a.dtype) == FLOAT)

    def at(self, origin):
        """This mod for a part of a problem whose first batch row, query head, query and
        key are origin = (b0, h0, q0, k0) of the whole (cuflash.dask's chunks): it reads
        b + b0, h + h0, q_idx + q0 and kv_idx + k0, the offsets from `origin` captured as
        `ORIGIN` (an int64 array of 4, which a score_mod and a mask_mod of one call share),
        so every part has the same key (one specialization for all of them)."""
        if ORIGIN in self.buffers:
            raise ValueError(f"{self.role} {self.name} is already a part's (it captures "
                             f"`{ORIGIN}`)")
        made = {}

        def rewrite(n):
            if id(n) not in made:
                if n.op == "arg" and n.value != "score":
                    i = Node("const", (), INT, ("b", "h", "q_idx", "kv_idx").index(n.value))
                    made[id(n)] = Node("add", (n, Node("index", (i,), INT, ORIGIN)), INT)
                else:
                    made[id(n)] = Node(n.op, [rewrite(a) for a in n.args], n.kind, n.value,
                                       n.where)
            return made[id(n)]

        if np.dtype(origin.dtype) != np.int64 or origin.shape != (4,):
            raise ValueError(f"origin must be an int64 array of 4 (b0, h0, q0, k0); got "
                             f"{origin.dtype} {origin.shape}")
        return self._replace(expr=rewrite(self.expr), buffers={**self.buffers, ORIGIN: origin})


def translate(fn, role):
    """The Mod of `fn` as a score_mod (role="score_mod": fn(score, b, h, q_idx, kv_idx)
    → float) or a mask_mod (role="mask_mod": fn(b, h, q_idx, kv_idx) → bool)."""
    if role not in ("score_mod", "mask_mod"):
        raise ValueError(f"role must be 'score_mod' or 'mask_mod'; got {role!r}")
    if isinstance(fn, Mod) and fn.role == role:  # translated already
        return fn
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"{role} must be a Python function (def or lambda); got "
                        f"{type(fn).__name__}")
    names = ARGS if role == "score_mod" else ARGS[1:]
    reader = _Reader(fn, role, {}, 0)
    params = reader.params()
    if len(params) != len(names):
        raise TypeError(f"{role} {fn.__qualname__} must take {len(names)} arguments "
                        f"({', '.join(names)}); it takes {len(params)}")
    args = [Node("arg", (), ARG_KINDS[n], n) for n in names]
    expr = reader.body(args)
    want = FLOAT if role == "score_mod" else BOOL
    if role == "score_mod" and expr.kind == INT:
        expr = Node("cast", (expr,), FLOAT, FLOAT, expr.where)
    if expr.kind != want:
        what = "a float (the modified score)" if want == FLOAT else "a boolean (True: may attend)"
        got = {FLOAT: "a float", INT: "an integer", BOOL: "a boolean"}[expr.kind]
        raise TypeError(f"{role} {fn.__qualname__} ({expr.where}) must return {what}; it "
                        f"returns {got}")
    return Mod(role, fn.__qualname__, expr, reader.buffers)


def _kind_of_dtype(dtype):
    kind = np.dtype(dtype).kind
    if kind == "f" or np.dtype(dtype).name == "bfloat16":
        return FLOAT
    if kind in "iu":
        return INT
    if kind == "b":
        return BOOL
    return None


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype") and getattr(x, "ndim", 0) >= 1


def _is_numeric_module(x):
    return isinstance(x, types.ModuleType) and x.__name__ in ("numpy", "cupy", "math")


class _Reader:
    """Reads one function; `buffers` is shared with the helpers it inlines."""

    def __init__(self, fn, role, buffers, depth):
        if depth > _MAX_DEPTH:
            raise TypeError(f"{role} {fn.__qualname__}: helper calls nest deeper than "
                            f"{_MAX_DEPTH} (recursion is not supported)")
        self.fn, self.role, self.buffers, self.depth = fn, role, buffers, depth
        try:
            lines, first = inspect.getsourcelines(fn)
        except (OSError, TypeError) as e:
            raise TypeError(f"{role} {fn.__qualname__}: its source cannot be read ({e}); "
                            f"define it in a file or a notebook cell") from None
        self.file = inspect.getsourcefile(fn) or "<unknown>"
        self.first = first
        tree = None
        if fn.__code__.co_name != "<lambda>":
            tree = ast.parse(textwrap.dedent("".join(lines)))
        self.node = self._find(tree)
        cv = inspect.getclosurevars(fn)
        self.outer = {**cv.builtins, **cv.globals, **cv.nonlocals}

    def _find(self, tree):
        code = self.fn.__code__
        if code.co_name == "<lambda>":
            return self._lambda()
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and n.name == code.co_name:
                return n
        raise TypeError(f"{self.role} {self.fn.__qualname__}: its definition was not "
                        f"found in its source")  # pragma: no cover - decorated oddities

    def _lambda(self):
        """The lambda's node: its lines may be part of a bigger statement (a call's
        argument, a for header), so each `lambda` in them is parsed alone, cut at the
        longest text that is an expression."""
        text = textwrap.dedent("".join(inspect.getsourcelines(self.fn)[0]))
        found, start = [], text.find("lambda")
        while start >= 0:
            for end in range(len(text), start, -1):
                try:
                    node = ast.parse(text[start:end].strip(), mode="eval").body
                except SyntaxError:
                    continue
                if isinstance(node, ast.Lambda):
                    found.append(node)
                break
            start = text.find("lambda", start + 1)
        nargs = self.fn.__code__.co_argcount
        found = [n for n in found if len(n.args.args) == nargs]
        if len(found) != 1:
            raise TypeError(f"{self.role} at {self.file}:{self.first}: {len(found)} lambdas "
                            f"of {nargs} arguments on its lines; define it with def")
        return found[0]

    def where(self, node):
        return f"{self.file}, line {self.first + getattr(node, 'lineno', 1) - 1}"

    def fail(self, node, what, cls=TypeError):
        raise cls(f"{self.role} {self.fn.__qualname__} ({self.where(node)}): {what}. "
                  + ("" if cls is ValueError else f"Allowed: {ALLOWED}"))

    # -- the function ----------------------------------------------------------------
    def params(self):
        a = self.node.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
            self.fail(self.node, "*args, **kwargs, keyword-only arguments and defaults "
                                 "are not supported")
        return [p.arg for p in a.args]

    def body(self, args):
        """The function's result with its parameters bound to the nodes `args`."""
        env = dict(zip(self.params(), args))
        if isinstance(self.node, ast.Lambda):
            return self.expr(self.node.body, env)
        stmts = self.node.body
        if (stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant)
                and isinstance(stmts[0].value.value, str)):
            stmts = stmts[1:]  # the docstring
        for i, s in enumerate(stmts):
            last = i == len(stmts) - 1
            if isinstance(s, ast.Return) and s.value is not None:
                if not last:
                    self.fail(s, "code after `return` is not supported")
                return self.expr(s.value, env)
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                env[s.targets[0].id] = self.expr(s.value, env)
            elif isinstance(s, ast.Assign) and len(s.targets) == 1 and _unpacks(s.targets[0], s.value):
                values = [self.expr(v, env) for v in s.value.elts]   # all read, then bound
                env.update(zip((t.id for t in s.targets[0].elts), values))
            elif isinstance(s, ast.AnnAssign) and s.value is not None and isinstance(s.target, ast.Name):
                env[s.target.id] = self.expr(s.value, env)
            elif isinstance(s, ast.Pass):
                continue
            else:
                self.fail(s, f"`{_statement_name(s)}` is not supported")
        self.fail(self.node, "the function must end with `return <expression>`")

    # -- expressions -----------------------------------------------------------------
    def expr(self, n, env):
        w = self.where(n)
        if isinstance(n, ast.Constant):
            return self.const(n, n.value)
        if isinstance(n, ast.Name):
            if n.id in env:
                return env[n.id]
            return self.captured(n, n.id)
        if isinstance(n, ast.Attribute):
            return self.const(n, self.attribute(n))
        if isinstance(n, ast.BinOp):
            op = _BINOPS.get(type(n.op))
            if op is None:
                self.fail(n, f"the operator {type(n.op).__name__} is not supported")
            return self.binop(n, op, self.expr(n.left, env), self.expr(n.right, env))
        if isinstance(n, ast.UnaryOp):
            a = self.expr(n.operand, env)
            if isinstance(n.op, ast.USub):
                return Node("neg", (self.numeric(n, a),), self.numeric(n, a).kind, None, w)
            if isinstance(n.op, ast.UAdd):
                return self.numeric(n, a)
            if isinstance(n.op, ast.Not):
                if a.kind != BOOL:
                    self.fail(n, "`not` needs a boolean")
                return Node("invert", (a,), BOOL, None, w)
            if a.kind == FLOAT:  # ast.Invert
                self.fail(n, "`~` needs a boolean or an integer, not a float")
            return Node("invert", (a,), a.kind, None, w)
        if isinstance(n, ast.BoolOp):
            vals = [self.expr(v, env) for v in n.values]
            if any(v.kind != BOOL for v in vals):
                self.fail(n, "`and`/`or` need booleans (comparisons); use & and | on arrays")
            op = "and" if isinstance(n.op, ast.And) else "or"
            out = vals[0]
            for v in vals[1:]:
                out = Node(op, (out, v), BOOL, None, w)
            return out
        if isinstance(n, ast.Compare):
            left, out = self.expr(n.left, env), None
            for op, right_n in zip(n.ops, n.comparators):
                name = _COMPARE.get(type(op))
                if name is None:
                    self.fail(n, f"the comparison {type(op).__name__} is not supported")
                right = self.expr(right_n, env)
                a, b = self.promote(n, left, right)
                c = Node(name, (a, b), BOOL, None, w)
                out = c if out is None else Node("and", (out, c), BOOL, None, w)
                left = right
            return out
        if isinstance(n, ast.IfExp):
            cond = self.expr(n.test, env)
            if cond.kind != BOOL:
                self.fail(n, "the condition of `x if c else y` must be a boolean")
            return self.where_node(n, cond, self.expr(n.body, env), self.expr(n.orelse, env))
        if isinstance(n, ast.Call):
            return self.call(n, env)
        if isinstance(n, ast.Subscript):
            return self.index(n, env)
        self.fail(n, f"`{_expression_name(n)}` is not supported")

    def const(self, n, value):
        w = self.where(n)
        if isinstance(value, (bool, np.bool_)):
            return Node("const", (), BOOL, bool(value), w)
        if isinstance(value, (int, np.integer)):
            if not -2 ** 63 <= int(value) < 2 ** 63:
                self.fail(n, f"the integer {value} does not fit in 64 bits", ValueError)
            return Node("const", (), INT, int(value), w)
        if isinstance(value, (float, np.floating)):
            return Node("const", (), FLOAT, float(value), w)
        self.fail(n, f"the value {value!r} ({type(value).__name__}) is not a number")

    def captured(self, n, name):
        if name not in self.outer:
            self.fail(n, f"the name `{name}` is not defined", ValueError)
        value = self.outer[name]
        if _is_array(value):
            self.fail(n, f"the captured array `{name}` must be indexed, e.g. {name}[i]")
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if callable(value) or isinstance(value, types.ModuleType):
            self.fail(n, f"`{name}` can only be called")
        return self.const(n, value)

    def attribute(self, n):
        base = n.value
        if not (isinstance(base, ast.Name) and _is_numeric_module(self.outer.get(base.id))):
            self.fail(n, "attributes are not supported (except NumPy's and math's "
                         "functions and constants: np.exp, np.pi, ...)")
        if n.attr not in _CONSTANTS:
            self.fail(n, f"`{base.id}.{n.attr}` is not a supported constant "
                         f"({', '.join(_CONSTANTS)})")
        return _CONSTANTS[n.attr]

    def numeric(self, n, a):
        """a as a number: booleans count as integers in arithmetic, as in Python."""
        if a.kind == BOOL:
            return Node("cast", (a,), INT, INT, a.where)
        return a

    def promote(self, n, a, b):
        """a and b of one kind (booleans compare with booleans; numbers promote to
        float if either is)."""
        if a.kind == BOOL and b.kind == BOOL:
            return a, b
        a, b = self.numeric(n, a), self.numeric(n, b)
        if a.kind != b.kind:
            a, b = (x if x.kind == FLOAT else Node("cast", (x,), FLOAT, FLOAT, x.where)
                    for x in (a, b))
        return a, b

    def binop(self, n, op, a, b):
        w = self.where(n)
        if op in ("and", "or", "xor"):
            if FLOAT in (a.kind, b.kind):
                self.fail(n, f"`{_SYMBOL[op]}` needs booleans or integers, not floats")
            if a.kind == BOOL and b.kind == BOOL:
                return Node(op, (a, b), BOOL, None, w)
            a, b = self.numeric(n, a), self.numeric(n, b)
            return Node(op, (a, b), INT, None, w)
        if op in ("lshift", "rshift"):
            a, b = self.numeric(n, a), self.numeric(n, b)
            if FLOAT in (a.kind, b.kind):
                self.fail(n, f"`{_SYMBOL[op]}` needs integers")
            return Node(op, (a, b), INT, None, w)
        a, b = self.promote(n, a, b)
        if op == "div":
            a, b = (x if x.kind == FLOAT else Node("cast", (x,), FLOAT, FLOAT, w) for x in (a, b))
        if op == "pow" and a.kind == INT and not (b.op == "const" and b.value >= 0):
            self.fail(n, "an integer power needs a constant exponent ≥ 0; write float(x) ** y")
        return Node(op, (a, b), a.kind, None, w)

    def where_node(self, n, cond, a, b):
        a, b = self.promote(n, a, b)
        return Node("where", (cond, a, b), a.kind, None, self.where(n))

    def resolve_callee(self, n):
        """('builtin' | 'numpy' | 'python', name or function) of a call's target."""
        f = n.func
        if isinstance(f, ast.Name):
            value = self.outer.get(f.id)
            if isinstance(value, types.FunctionType):
                return "python", value
            if isinstance(value, types.BuiltinFunctionType) and f.id in ("abs", "min", "max"):
                return "builtin", f.id
            if value in (int, float, bool):
                return "builtin", f.id
            if isinstance(value, np.ufunc) or (value is not None and getattr(value, "__module__", "") == "math"):
                return "numpy", value.__name__
            self.fail(n, f"`{f.id}` cannot be called here")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and _is_numeric_module(
                self.outer.get(f.value.id)):
            return "numpy", f.attr
        self.fail(n, "only functions by name and NumPy's / math's functions (np.exp) "
                     "can be called")

    def call(self, n, env):
        w = self.where(n)
        if n.keywords:
            self.fail(n, "keyword arguments are not supported")
        where, target = self.resolve_callee(n)
        args = [self.expr(a, env) for a in n.args]
        if where == "python":
            helper = _Reader(target, self.role, self.buffers, self.depth + 1)
            if len(helper.params()) != len(args):
                self.fail(n, f"{target.__qualname__} takes {len(helper.params())} arguments; "
                             f"got {len(args)}")
            return helper.body(args)
        name = _ALIASES.get(target, target)
        if where == "builtin" and name in ("min", "max"):
            name = "minimum" if name == "min" else "maximum"
            if len(args) < 2:
                self.fail(n, f"{target}() needs two or more arguments")
            out = args[0]
            for b in args[1:]:
                out = self.kind_call(n, name, [out, b])
            return out
        if name in _CASTS:
            if len(args) != 1:
                self.fail(n, f"{target}() takes one argument")
            kind = _CASTS[name]
            a = args[0]
            if a.kind == kind:
                return a
            return Node("cast", (a,), kind, kind, w)
        if name in FLOAT_FUNCS:
            if len(args) != 1:
                self.fail(n, f"{target}() takes one argument")
            a = self.numeric(n, args[0])
            if a.kind != FLOAT:
                a = Node("cast", (a,), FLOAT, FLOAT, w)
            return Node("call", (a,), FLOAT, name, w)
        if name in KIND_FUNCS:
            return self.kind_call(n, name, args)
        self.fail(n, f"`{target}` is not a supported function")

    def kind_call(self, n, name, args):
        w = self.where(n)
        arity = {"where": 3, "clip": 3, "minimum": 2, "maximum": 2}.get(name, 1)
        if len(args) != arity:
            self.fail(n, f"{name}() takes {arity} argument{'s' if arity > 1 else ''} here")
        if name == "where":
            if args[0].kind != BOOL:
                self.fail(n, "the condition of where() must be a boolean")
            return self.where_node(n, *args)
        if name in ("minimum", "maximum"):
            a, b = self.promote(n, *args)
            return Node("call", (a, b), a.kind, name, w)
        if name == "clip":
            x, lo = self.promote(n, args[0], args[1])
            x, hi = self.promote(n, x, args[2])
            lo, hi = (v if v.kind == x.kind else Node("cast", (v,), x.kind, x.kind, w)
                      for v in (lo, hi))
            return Node("call", (x, lo, hi), x.kind, name, w)
        a = self.numeric(n, args[0])
        return Node("call", (a,), a.kind, name, w)

    def index(self, n, env):
        base = n.value
        if not isinstance(base, ast.Name) or base.id in env or not _is_array(self.outer.get(base.id)):
            self.fail(n, "only captured arrays can be indexed (by name: table[i, j])")
        name, arr = base.id, self.outer[base.id]
        kind = _kind_of_dtype(arr.dtype)
        if kind is None:
            self.fail(n, f"the captured array `{name}` has dtype {arr.dtype}; float, integer "
                         f"or bool arrays are accepted", ValueError)
        known = self.buffers.get(name)
        if known is not None and known is not arr:
            self.fail(n, f"two different arrays are captured under the name `{name}`; "
                         f"rename one", ValueError)
        self.buffers[name] = arr
        parts = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
        if any(isinstance(p, (ast.Slice, ast.Starred)) for p in parts):
            self.fail(n, f"`{name}` must be indexed by integers (no slices)")
        if len(parts) != arr.ndim:
            self.fail(n, f"`{name}` has {arr.ndim} dimension{'s' if arr.ndim > 1 else ''} "
                         f"and takes {arr.ndim} ind{'ices' if arr.ndim > 1 else 'ex'}; got "
                         f"{len(parts)}", ValueError)
        idx = []
        for p in parts:
            i = self.numeric(n, self.expr(p, env))
            if i.kind != INT:
                self.fail(n, f"`{name}` must be indexed by integers; write int(x) to "
                             f"truncate a float")
            idx.append(i)
        return Node("index", idx, kind, name, self.where(n))


def _unpacks(target, value):
    """Whether `target = value` is `a, b = x, y` (names from a tuple of the same length)."""
    return (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            and len(target.elts) == len(value.elts)
            and all(isinstance(t, ast.Name) for t in target.elts))


_SYMBOL = {"and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}


def _statement_name(s):
    return {ast.For: "for", ast.While: "while", ast.If: "if", ast.With: "with",
            ast.Try: "try", ast.Raise: "raise", ast.Import: "import",
            ast.ImportFrom: "import", ast.AugAssign: "x op= y", ast.Global: "global",
            ast.Nonlocal: "nonlocal", ast.FunctionDef: "def", ast.Delete: "del",
            ast.Assert: "assert", ast.Return: "return without a value",
            ast.Assign: "assignment other than `x = ...` or `x, y = a, b`"}.get(
                type(s), type(s).__name__)


def _expression_name(n):
    return {ast.ListComp: "list comprehension", ast.GeneratorExp: "generator",
            ast.List: "list", ast.Tuple: "tuple", ast.Dict: "dict", ast.Lambda: "lambda",
            ast.JoinedStr: "f-string", ast.Starred: "*x"}.get(type(n), type(n).__name__)
