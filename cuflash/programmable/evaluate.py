"""A translated mod evaluated on whole tiles with NumPy, and its gradients.

`Bound` is a Mod with its buffers read for one call (floats in the accumulation dtype,
integers as int64). `Bound.value(env)` evaluates the expression for broadcastable index
arrays and a score tile: one NumPy call per node. `Bound.gradients(env, seed)` runs the
expression forward, then back (reverse mode, one rule per operation below): the gradient
with respect to the score, and the scatter-add of the seed times ∂mod/∂buffer into each
captured float array (`np.bincount`, a sum in a fixed order: deterministic).
"""
import math

import numpy as np

from .ir import BOOL, FLOAT, INT

_INT = np.dtype(np.int64)

# elementwise functions: name → NumPy function
_FUNCS = {"exp": np.exp, "exp2": np.exp2, "expm1": np.expm1, "log": np.log,
          "log2": np.log2, "log10": np.log10, "log1p": np.log1p, "sqrt": np.sqrt,
          "tanh": np.tanh, "sinh": np.sinh, "cosh": np.cosh, "sin": np.sin, "cos": np.cos,
          "tan": np.tan, "arctan": np.arctan, "floor": np.floor, "ceil": np.ceil,
          "trunc": np.trunc, "abs": np.abs, "square": np.square, "sign": np.sign,
          "minimum": np.minimum, "maximum": np.maximum, "clip": np.clip}
_ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "floordiv": np.floor_divide, "mod": np.mod, "pow": np.power}
_BITS_INT = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
             "lshift": np.left_shift, "rshift": np.right_shift}
_BITS_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
            "eq": np.equal, "ne": np.not_equal}


class Bound:
    """A Mod ready to evaluate in the accumulation dtype `acc_t` (float32 or float64)."""

    def __init__(self, mod, acc_t):
        self.mod, self.acc_t = mod, np.dtype(acc_t)
        self.order = mod.expr.walk()
        self.arrays = {}
        for name, a in mod.buffers.items():
            if not isinstance(a, np.ndarray):
                raise ValueError(f"{mod.role} {mod.name}: the captured array `{name}` is a "
                                 f"{type(a).__module__}.{type(a).__name__}; the NumPy backend "
                                 f"reads NumPy arrays (numpy.asarray it, or use the cuda backend)")
            kind = np.dtype(a.dtype).kind
            self.arrays[name] = a.astype(self.acc_t if kind not in "iub" else
                                         (bool if kind == "b" else _INT), copy=False)

    # -- forward --------------------------------------------------------------------
    def value(self, env):
        """The mod's value for `env`: {"score": float tile, "b", "h", "q_idx", "kv_idx":
        int64 arrays}, all broadcastable to the tile."""
        return self._values(env)[id(self.mod.expr)]

    def _values(self, env):
        vals = {}
        for n in self.order:
            vals[id(n)] = self._node(n, [vals[id(a)] for a in n.args], env)
        return vals

    def _node(self, n, a, env):
        op, acc = n.op, self.acc_t
        if op == "arg":
            return env[n.value]
        if op == "const":
            return {FLOAT: acc.type, INT: np.int64, BOOL: np.bool_}[n.kind](n.value)
        if op == "cast":
            if n.kind == BOOL:
                return np.not_equal(a[0], 0)
            if n.kind == INT and a[0].dtype.kind == "f":
                return np.trunc(a[0]).astype(_INT)   # as int(): toward zero
            return np.asarray(a[0]).astype(acc if n.kind == FLOAT else _INT)
        if op in _ARITH:
            if n.kind == INT and op in ("floordiv", "mod") and np.any(np.equal(a[1], 0)):
                raise ValueError(f"{self.mod.role} {self.mod.name} ({n.where}): integer "
                                 f"division by zero")
            return _ARITH[op](*a, dtype=acc if n.kind == FLOAT else _INT)
        if op == "neg":
            return np.negative(a[0])
        if op == "invert":
            return np.logical_not(a[0]) if n.kind == BOOL else np.invert(a[0])
        if op in _BITS_BOOL and n.kind == BOOL:
            return _BITS_BOOL[op](*a)
        if op in _BITS_INT:
            return _BITS_INT[op](*a)
        if op in _COMPARE:
            return _COMPARE[op](*a)
        if op == "where":
            return np.where(*a)
        if op == "call":
            return _FUNCS[n.value](*a)
        if op == "index":
            return self._read(n, a)
        raise AssertionError(f"unknown operation {op}")  # pragma: no cover

    def _read(self, n, idx):
        arr = self.arrays[n.value]
        for axis, i in enumerate(idx):
            lo, hi = int(np.min(i)), int(np.max(i))
            if lo < 0 or hi >= arr.shape[axis]:
                raise ValueError(
                    f"{self.mod.role} {self.mod.name} ({n.where}): index {lo if lo < 0 else hi} "
                    f"is out of range for axis {axis} of `{n.value}` (size {arr.shape[axis]})")
        return arr[tuple(idx)]

    # -- backward -------------------------------------------------------------------
    def gradients(self, env, seed):
        """(∂/∂score of Σ seed·mod, {buffer name: ∂/∂buffer of the same}) for env's tile:
        seed is the gradient with respect to the mod's output (the tile's dS)."""
        vals = self._values(env)
        adj = {id(self.mod.expr): seed}
        dscore = None
        grads = {name: None for name in self.mod.float_buffers()}
        for n in reversed(self.order):
            g = adj.pop(id(n), None)
            if g is None or n.kind != FLOAT:
                continue
            if n.op == "arg":                        # the score
                dscore = g if dscore is None else dscore + g
            elif n.op == "index":                    # scatter-add into the buffer
                grads[n.value] = _scatter(grads[n.value], self.arrays[n.value].shape,
                                          [vals[id(i)] for i in n.args], g)
            else:
                for arg, ga in _rule(n, [vals[id(a)] for a in n.args], vals[id(n)], g):
                    if arg.kind == FLOAT and ga is not None:
                        key = id(arg)
                        adj[key] = ga if key not in adj else adj[key] + ga
        if dscore is None:
            dscore = np.zeros_like(seed)
        return np.broadcast_to(dscore, seed.shape), grads


def _scatter(acc, shape, idx, g):
    """acc + the sum of g into a zero array of `shape` at the broadcast indices idx."""
    *idx, g = np.broadcast_arrays(*idx, g)
    flat = np.ravel_multi_index(tuple(i.ravel() for i in idx), shape)
    part = np.bincount(flat, weights=g.ravel(), minlength=math.prod(shape)).reshape(shape)
    return part if acc is None else acc + part


def _rule(n, a, y, g):
    """(argument node, its adjoint) pairs of node n with argument values a, value y and
    adjoint g (adjoints keep the tile's shape: only the score and the buffers take them)."""
    op, args = n.op, n.args
    if op == "cast":                                  # float(x) of a float: identity
        return [(args[0], g)] if args[0].kind == FLOAT else []
    if op == "neg":
        return [(args[0], -g)]
    if op == "add":
        return [(args[0], g), (args[1], g)]
    if op == "sub":
        return [(args[0], g), (args[1], -g)]
    if op == "mul":
        return [(args[0], g * a[1]), (args[1], g * a[0])]
    if op == "div":
        return [(args[0], g / a[1]), (args[1], -g * y / a[1])]
    if op == "pow":
        out = [(args[0], g * a[1] * a[0] ** (a[1] - 1))]
        if args[1].op != "const":
            with np.errstate(divide="ignore", invalid="ignore"):
                out.append((args[1], np.where(g == 0, 0, g * y * np.log(a[0]))))
        return out
    if op == "floordiv":
        return []
    if op == "mod":                                   # a − b·floor(a/b)
        return [(args[0], g), (args[1], -g * np.floor_divide(a[0], a[1]))]
    if op == "where":
        return [(args[1], np.where(a[0], g, 0)), (args[2], np.where(a[0], 0, g))]
    if op != "call":
        return []
    f, x = n.value, a[0]
    if f in ("minimum", "maximum"):
        first = (x <= a[1]) if f == "minimum" else (x >= a[1])   # ties: the first
        return [(args[0], np.where(first, g, 0)), (args[1], np.where(first, 0, g))]
    if f == "clip":
        inside = (x >= a[1]) & (x <= a[2])
        return [(args[0], np.where(inside, g, 0)), (args[1], np.where(x < a[1], g, 0)),
                (args[2], np.where(x > a[2], g, 0))]
    d = {"exp": lambda: y, "exp2": lambda: y * math.log(2), "expm1": lambda: y + 1,
         "log": lambda: 1 / x, "log2": lambda: 1 / (x * math.log(2)),
         "log10": lambda: 1 / (x * math.log(10)), "log1p": lambda: 1 / (1 + x),
         "sqrt": lambda: 0.5 / y, "tanh": lambda: 1 - y * y, "sinh": lambda: np.cosh(x),
         "cosh": lambda: np.sinh(x), "sin": lambda: np.cos(x), "cos": lambda: -np.sin(x),
         "tan": lambda: 1 + y * y, "arctan": lambda: 1 / (1 + x * x),
         "abs": lambda: np.sign(x), "square": lambda: 2 * x}.get(f)
    if d is None:                                     # floor, ceil, trunc, sign: flat
        return []
    return [(args[0], g * d())]

