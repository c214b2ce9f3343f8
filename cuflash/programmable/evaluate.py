"""A translated mod evaluated on whole tiles with NumPy, and its gradients.

`Bound` is a Mod with its buffers read for one call (floats in the accumulation dtype,
integers as int64). `Bound.value(env)` evaluates the expression for broadcastable index
arrays and a score tile: one NumPy call per node, integers in int32 where the node's range
(`ranges.int_ranges`, from the call's sizes) fits it, and an index checked against its
array only where its range does not prove it inside; the parts that depend on the
positions only through q_idx − kv_idx once per diagonal, read as a Toeplitz view
(`toeplitz`). `Bound.evaluate` keeps the values it computed (`_Getter`), in place where a
tile has one reader. `Bound.gradients(env, seed, into)` runs the expression forward (or
takes the forward's evaluation), then back (reverse mode, one rule per operation below,
along the paths to what is wanted, constant factors carried as scalars): the gradient
with respect to the score, and the scatter-add of the seed times ∂mod/∂buffer into each
captured float array's accumulator (`np.bincount`, a sum in a fixed order:
deterministic).
"""
import collections
import hashlib
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .ir import BOOL, FLOAT, INT
from .ranges import fits_int32, int_ranges

_INT = np.dtype(np.int64)
_INT32 = np.dtype(np.int32)

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
    """A Mod ready to evaluate in the accumulation dtype `acc_t` (float32 or float64);
    `arg_ranges` ({"b": (lo, hi), "h": ..., "q_idx": ..., "kv_idx": ...}, inclusive), when
    given, bound the index arguments of every call (see `ranges`)."""

    def __init__(self, mod, acc_t, arg_ranges=None):
        self.mod, self.acc_t = mod, np.dtype(acc_t)
        self.order = mod.expr.walk()
        self.arrays = {}
        for name, a in mod.buffers.items():
            if not isinstance(a, np.ndarray):
                raise ValueError(f"{mod.role} {mod.name}: the captured array `{name}` is a "
                                 f"{type(a).__module__}.{type(a).__name__}; the NumPy backend "
                                 f"reads NumPy arrays (numpy.asarray it, or use the cuda backend)")
            kind = np.dtype(a.dtype).kind
            self.arrays[name] = np.ascontiguousarray(a, self.acc_t if kind not in "iub" else
                                                     (bool if kind == "b" else _INT))
        buffer_ranges = {name: (int(a.min()), int(a.max())) for name, a in self.arrays.items()
                         if a.dtype == _INT and a.size}
        ranges = int_ranges(self.order, arg_ranges or {}, buffer_ranges)
        # the integer dtype of each node, and the index reads that need a bounds check
        self.int_dtype = {k: _INT32 if fits_int32(r) else _INT for k, r in ranges.items()}
        self.check = {id(n): not all(ranges.get(id(i)) is not None and ranges[id(i)][0] >= 0
                                     and ranges[id(i)][1] < self.arrays[n.value].shape[axis]
                                     for axis, i in enumerate(n.args))
                      for n in self.order if n.op == "index"}
        for name, r in buffer_ranges.items():
            if fits_int32(r):
                self.arrays[name] = self.arrays[name].astype(_INT32)
        self.relative = _relative_roots(self.order)
        # how many times each node is an argument (one use: its tile may take its consumer's
        # result, see `evaluate`), the score counted over all its nodes
        self.uses = collections.Counter(id(a) for n in self.order for a in n.args)
        self.score_uses = sum(self.uses[id(n)] for n in self.order if n.op == "arg"
                              and n.kind == FLOAT)
        # a score read once, as score·c or score / c with c > 0: (that node, its factor);
        # a caller that computes the scores times the factor saves the mod that pass
        # (`evaluate`'s `prescaled`)
        self.score_factor = None
        if self.score_uses == 1:
            readers = [n for n in self.order
                       if any(a.op == "arg" and a.kind == FLOAT for a in n.args)]
            p = readers[0] if len(readers) == 1 else None
            c = next((a for a in p.args if a.op == "const"), None) if p else None
            f = float(c.value) if c is not None and c.kind == FLOAT else 0.0
            if f > 0 and p.op == "mul":
                self.score_factor = (id(p), f)
            elif f > 0 and p.op == "div" and p.args[1] is c:
                self.score_factor = (id(p), 1.0 / f)
        # a mod that ends in a product with (a quotient by) a constant: (the other factor,
        # the constant), for a caller that scales the result anyway (one pass for both)
        # (none where the root is the score's own reader: a prescaled score has it already)
        root, self.root_factor = self.mod.expr, None
        if root.op in ("mul", "div") and root.kind == FLOAT and not (
                self.score_factor and self.score_factor[0] == id(root)):
            a, b = root.args
            if b.op == "const" and b.kind == FLOAT and b.value and a.kind == FLOAT:
                self.root_factor = (a, float(b.value) if root.op == "mul" else 1.0 / b.value)
            elif root.op == "mul" and a.op == "const" and a.kind == FLOAT and b.kind == FLOAT:
                self.root_factor = (b, float(a.value))
        # the float ufunc nodes' arguments whose tile their result may take (`evaluate`'s
        # reuse): (position, whether it holds the caller's score tile), the argument's
        # only use
        scored = {id(n) for n in self.order if n.op == "arg" and n.kind == FLOAT}
        if self.score_factor:
            scored.add(self.score_factor[0])
        self.spares = {id(n): tuple(
            (i, id(a) in scored) for i, a in enumerate(n.args)
            if (a.op == "arg" and a.kind == FLOAT and self.score_uses == 1)
            or (a.op not in ("arg", "const") and id(a) not in self.relative
                and self.uses[id(a)] == 1))
            for n in self.order if n.kind == FLOAT and (n.op in _ARITH or n.op in ("neg", "call"))}
        self.consts = {id(n): {FLOAT: self.acc_t.type, INT: self.int_dtype.get(id(n), _INT).type,
                               BOOL: np.bool_}[n.kind](n.value)
                       for n in self.order if n.op == "const"}
        # The relative parts' tiles, as views of their diagonals (`_Getter`), keyed by the
        # part (its place in the walk), the tile and the heads — and, where the arrays the
        # parts read are small, by what identifies their values across calls (the mod's
        # key and those arrays' bytes): then kept from call to call, as a loop repeats.
        self.node_index = {id(n): i for i, n in enumerate(self.order)}
        self.diagonals, self.values_key = {}, None
        read = {n.value for r in self.order if id(r) in self.relative
                for n in r.walk() if n.op == "index"}
        if self.relative and sum(self.arrays[name].nbytes for name in read) <= _DIGESTED_BYTES:
            digest = hashlib.blake2b(digest_size=16)
            for name in sorted(read):
                a = self.arrays[name]
                digest.update(f"{name}{a.dtype.str}{a.shape}".encode())
                digest.update(a.tobytes())
            self.values_key = (mod.key(), self.acc_t.str, digest.hexdigest())
            self.diagonals = _KEPT_DIAGONALS
        # the nodes through which the score's and the float buffers' gradients flow
        self.score_path = _reaching(self.order, lambda n: n.op == "arg" and n.kind == FLOAT)
        self.buffer_path = _reaching(self.order, lambda n: n.op == "index" and n.kind == FLOAT)

    # -- forward --------------------------------------------------------------------
    def value(self, env, tile=None):
        """The mod's value for `env`: {"score": float tile, "b", "h", "q_idx", "kv_idx":
        int64 arrays}, all broadcastable to the tile. `tile` = (q_idx − kv_idx at the
        tile's first row and key, rows, keys), when given, lets the parts of the mod that
        depend on the positions only through q_idx − kv_idx (a relative position bias's
        bucket and table entry, ALiBi's distance) be computed once per diagonal, on a
        vector, and read as a Toeplitz view of the tile."""
        return self.evaluate(env, tile)(self.mod.expr)

    def evaluate(self, env, tile=None, reuse=False, prescaled=False):
        """The evaluation of the mod for `env` (and `tile`, as in `value`): a function
        giving any node's value, computed on first use and kept — call it with the mod's
        expression for its value, and hand it to `gradients` to reuse what it computed.
        With `reuse` (for the value alone: no gradients), a float tile that only one node
        reads — the score too, with reuse="score" — takes that node's result in place:
        fewer tiles allocated and passed through the caches. With `prescaled`, env's
        "score" is the score times `score_factor` already: the value of the node that
        multiplied it."""
        return _Getter(self, env, tile, reuse, prescaled)

    def _diagonals(self, env, tile):
        """A `_Getter` giving a relative node's values along the tile's rows + keys − 1
        diagonals, the last axis: q_idx − kv_idx = off + rows − 1 − k for the k-th (kv_idx
        = 0, q_idx the distance: a relative node sees only their difference)."""
        off, rows, cols = tile
        return _Getter(self, {**env, "q_idx": off + rows - 1 - np.arange(rows + cols - 1),
                              "kv_idx": np.int64(0)})

    def _node(self, n, a, env, out=None):
        """Node n's value from its arguments' a (into `out` where given: see _Getter)."""
        op, acc = n.op, self.acc_t
        it = self.int_dtype.get(id(n), _INT)
        if op == "arg":
            return env[n.value] if n.kind == FLOAT else _as_int(env[n.value], it)
        if op == "const":
            return self.consts[id(n)]
        if op == "cast":
            if n.kind == BOOL:
                return np.not_equal(a[0], 0)
            if n.kind == INT and a[0].dtype.kind == "f":
                return np.trunc(a[0]).astype(it)   # as int(): toward zero
            return np.asarray(a[0]).astype(acc if n.kind == FLOAT else it)
        if op in _ARITH:
            if n.kind == INT and op in ("floordiv", "mod") and np.any(np.equal(a[1], 0)):
                raise ValueError(f"{self.mod.role} {self.mod.name} ({n.where}): integer "
                                 f"division by zero")
            return _ARITH[op](*a, dtype=acc if n.kind == FLOAT else it, out=out)
        if op == "neg":
            return np.negative(a[0], dtype=it) if n.kind == INT else np.negative(a[0], out=out)
        if op == "invert":
            return np.logical_not(a[0]) if n.kind == BOOL else np.invert(a[0], dtype=it)
        if op in _BITS_BOOL and n.kind == BOOL:
            return _BITS_BOOL[op](*a)
        if op in _BITS_INT:
            return _BITS_INT[op](*a, dtype=it)
        if op in _COMPARE:
            return _COMPARE[op](*a)
        if op == "where":
            return np.where(*a)
        if op == "call":
            if n.kind == INT and n.value != "clip":
                return _FUNCS[n.value](*a, dtype=it)
            return _FUNCS[n.value](*a, out=out)
        if op == "index":
            return self._read(n, a)
        raise AssertionError(f"unknown operation {op}")  # pragma: no cover

    def _read(self, n, idx):
        """arr[idx]: a read-only strided view where every index is affine in the tile's
        axes (`_affine`: a bias read at [b, h, q_idx, kv_idx], a table at [h]), else
        np.take of the flat index (3× faster than a tuple of index arrays; the small,
        broadcast index arrays are scaled before they meet the big ones)."""
        arr = self.arrays[n.value]
        if self.check[id(n)]:
            for axis, i in enumerate(idx):
                lo, hi = int(np.min(i)), int(np.max(i))
                if lo < 0 or hi >= arr.shape[axis]:
                    raise ValueError(
                        f"{self.mod.role} {self.mod.name} ({n.where}): index "
                        f"{lo if lo < 0 else hi} is out of range for axis {axis} of "
                        f"`{n.value}` (size {arr.shape[axis]})")
        steps = [s // arr.itemsize for s in arr.strides]
        shape = np.broadcast_shapes(*(np.shape(i) for i in idx))
        view = _strided_read(arr, idx, steps, shape)
        if view is not None:
            return view
        wide = arr.size > 2 ** 31 - 1          # a flat index past int32
        flat = None
        for i, step in zip(idx, steps):
            i = i.astype(_INT) if wide else i
            term = i if step == 1 else i * step
            flat = term if flat is None else flat + term
        return np.take(arr.reshape(-1), flat)

    # -- backward -------------------------------------------------------------------
    def gradients(self, env, seed, into=None, tile=None, evaluation=None):
        """∂/∂score of Σ seed·mod for env's tile (seed: the gradient with respect to the
        mod's output, the tile's dS); with `into` ({buffer name: float64 array of its
        shape}), the buffers' gradients Σ seed·∂mod/∂buffer are added there too. Only
        the nodes on a path to the score (and to a wanted buffer) are differentiated;
        `tile` as in `value`; `evaluation`, the forward's (`evaluate`), to reuse its
        values (env and tile are then its own)."""
        want = self.score_path | (self.buffer_path if into is not None else set())
        val = evaluation or self.evaluate(env, tile)   # only the values the rules ask for
        # adjoints as (tile, factor): a constant factor (a product with or a quotient by
        # a constant, a negation) is carried along, through the rules too (each is linear
        # in the adjoint), not multiplied into the tile until a sum of adjoints with other
        # factors, a buffer's scatter or the score's gradient needs it (softcap's 20 and
        # 1/20 then meet as 1: no pass)
        adj = {id(self.mod.expr): (seed, 1.0)}

        def add(key, g, f):
            if key in adj:
                g0, f0 = adj[key]
                g, f = (g0 + g, f) if f0 == f else (_scaled(g0, f0) + _scaled(g, f), 1.0)
            adj[key] = (g, f)

        dscore = None
        for n in reversed(self.order):
            g, f = adj.pop(id(n), (None, 1.0))
            if g is None or n.kind != FLOAT:
                continue
            if n.op == "arg":                        # the score
                dscore = _scaled(g, f) if dscore is None else dscore + _scaled(g, f)
            elif n.op == "index":                    # scatter-add into the buffer
                _scatter(into[n.value], [val(i) for i in n.args], _scaled(g, f))
            elif (c := self._constant_factor(n)) is not None:
                for arg in n.args:
                    if id(arg) in want:
                        add(id(arg), g, f * c[id(arg)])
            else:
                if f == 0:                           # a rule may guard g == 0 (pow's log)
                    g, f = _scaled(g, f), 1.0
                for arg, adjoint in _rule(n, _Values(val, n.args), lambda n=n: val(n), g):
                    if id(arg) in want:
                        add(id(arg), adjoint(), f)
        if dscore is None:
            dscore = np.zeros_like(seed)
        return np.broadcast_to(dscore, seed.shape)

    def _constant_factor(self, n):
        """{argument id: its constant factor} where node n is linear in its arguments with
        constant coefficients (a sum, a difference, a negation, a product with or a
        quotient by a constant), else None."""
        consts = self.consts
        if n.op == "neg":
            return {id(n.args[0]): -1.0}
        if n.op in ("add", "sub"):
            a, b = n.args
            return {id(a): 1.0, id(b): -1.0 if n.op == "sub" else 1.0} if a is not b else None
        if n.op == "mul" and n.args[0].op == "const":
            return {id(n.args[1]): float(consts[id(n.args[0])])}
        if n.op == "mul" and n.args[1].op == "const":
            return {id(n.args[0]): float(consts[id(n.args[1])])}
        if n.op == "div" and n.args[1].op == "const" and consts[id(n.args[1])] != 0:
            return {id(n.args[0]): 1.0 / float(consts[id(n.args[1])])}
        return None


# Relative parts kept (`_Getter`), a vector of rows + keys − 1 values each, by one Bound
# or, across calls, by all (_KEPT_DIAGONALS: Bound.values_key): cleared when full.
_DIAGONALS_KEPT = 4096
_KEPT_DIAGONALS = {}
# Arrays read by relative parts up to this size are hashed to keep their parts across calls.
_DIGESTED_BYTES = 1 << 20


def toeplitz(v, rows, cols):
    """The (…, rows, cols) tile whose entry (x, y) is v[…, rows − 1 − x + y], from v (…,
    rows + cols − 1): a read-only strided view (rows step back one element, columns
    forward one) of a function of y − x — a relative position's value on a tile."""
    v = np.ascontiguousarray(v)
    step = v.strides[-1]
    return as_strided(v[..., rows - 1:], v.shape[:-1] + (rows, cols),
                      v.strides[:-1] + (-step, step), writeable=False)


def _toeplitz(v, tile):
    """The tile of a relative node from its values v (…, 1, L) along the tile's diagonals
    (`Bound._diagonals`)."""
    _, rows, cols = tile
    v = np.asarray(v)
    return toeplitz(v.reshape(v.shape[:-2] + v.shape[-1:]) if v.ndim > 1 else v, rows, cols)


def _relative_roots(order):
    """The ids of the largest subtrees that depend on the positions only through
    q_idx − kv_idx (besides constants, captured arrays and the b and h arguments), with
    q_idx − kv_idx in them: their value on a tile is a function of the diagonal alone.
    A linear form a·q_idx + c·kv_idx (+, −, negation, multiples by constants) with a = −c
    counts as q_idx − kv_idx."""
    linear, dep = {}, {}
    for n in order:
        a = [linear.get(id(x)) for x in n.args]
        lin = None
        if n.op == "arg" and n.value in ("q_idx", "kv_idx"):
            lin = (1, 0) if n.value == "q_idx" else (0, 1)
        elif n.op == "const" and n.kind == INT:
            lin = (0, 0)
        elif n.op in ("add", "sub") and None not in a:
            sign = 1 if n.op == "add" else -1
            lin = (a[0][0] + sign * a[1][0], a[0][1] + sign * a[1][1])
        elif n.op == "neg" and None not in a:
            lin = (-a[0][0], -a[0][1])
        elif n.op == "mul" and None not in a and (a[0] == (0, 0) or a[1] == (0, 0)):
            c, other = (n.args[0], a[1]) if a[0] == (0, 0) else (n.args[1], a[0])
            if c.op == "const":
                lin = (c.value * other[0], c.value * other[1])
        linear[id(n)] = lin
        if lin is not None and lin[0] == -lin[1] != 0:
            dep[id(n)] = _REL                              # a function of q_idx − kv_idx
        elif n.op == "arg":
            dep[id(n)] = _CONST if n.value in ("b", "h") else _OTHER
        else:
            dep[id(n)] = max((dep[id(x)] for x in n.args), default=_CONST)
    parents = {}
    for n in order:
        for x in n.args:
            parents.setdefault(id(x), []).append(n)
    root = id(order[-1])
    return {k for k, d in dep.items() if d == _REL and (
        k == root or any(dep[id(p)] != _REL for p in parents.get(k, [])))}


# a node's dependence on the arguments, in rising order (b and h count as constants: a
# tile's are broadcast along its own axes, not the positions)
_CONST, _REL, _OTHER = 0, 1, 2


def _reaching(order, leaf):
    """The ids of the nodes with a `leaf` node among them or their arguments (at any depth)."""
    out = set()
    for n in order:
        if leaf(n) or any(id(a) in out for a in n.args):
            out.add(id(n))
    return out


def _scatter(acc, idx, g):
    """acc[idx] += g for broadcast indices idx, summed in index order (np.bincount over the
    span of flat positions the tile touches: deterministic, and O(tile) for a table)."""
    *idx, g = np.broadcast_arrays(*idx, g)
    flat = np.ravel_multi_index(tuple(i.ravel() for i in idx), acc.shape)
    lo, hi = int(flat.min()), int(flat.max())
    acc.reshape(-1)[lo:hi + 1] += np.bincount(flat - lo, weights=g.ravel(),
                                              minlength=hi - lo + 1)


def _kept(x, tag, make):
    """make(x), kept (with x, so that its id is not reused while kept) where x is a
    read-only array: the backends' cached positions, which a loop passes again and again.
    Cleared when full."""
    if x.flags.writeable:
        return make(x)
    key = (id(x), tag)
    kept = _KEPT.get(key)
    if kept is None or kept[0] is not x:
        if len(_KEPT) >= _DIAGONALS_KEPT:
            _KEPT.clear()
        kept = _KEPT[key] = (x, make(x))
    return kept[1]


_KEPT = {}


def _affine(i, ndim):
    """(first value, per-axis steps over `ndim` trailing-aligned axes) where the index
    array i is first + Σ step_p·x_p over its axes, else None. Checked on i itself, which
    is small where it is affine (a row of positions, a column of heads); `_kept`."""
    if np.ndim(i) == 0:
        return int(i), (0,) * ndim

    def fit(i):
        first = int(i.reshape(-1)[0]) if i.size else 0
        steps = [0] * ndim
        fit = np.full((1,) * i.ndim, first, _INT)
        for p, s in enumerate(i.shape):
            if s > 1:
                at = [0] * i.ndim
                at[p] = 1
                steps[ndim - i.ndim + p] = int(i[tuple(at)]) - first
                fit = fit + steps[ndim - i.ndim + p] * np.arange(s).reshape(
                    [s if q == p else 1 for q in range(i.ndim)])
        return (first, tuple(steps)) if np.array_equal(np.broadcast_to(fit, i.shape), i) else None
    return _kept(i, ("affine", ndim), fit)


def _as_int(x, it):
    """The index argument x in the integer dtype `it`; for a read-only array a read-only
    copy, `_kept`."""
    if type(x) is not np.ndarray or x.dtype == it:
        return np.asarray(x, it)

    def copy(x):
        y = x.astype(it)
        y.flags.writeable = x.flags.writeable
        return y
    return _kept(x, ("int", it), copy)


# An index array is tested for `_affine` only up to this share of the read's elements.
_AFFINE_SHARE = 8


def _strided_read(arr, idx, steps, shape):
    """arr[idx] as a read-only view of arr (contiguous, every index in range) where each
    index is affine in the result's axes, else None."""
    size = math.prod(shape)
    base, strides = 0, [0] * len(shape)
    for i, step in zip(idx, steps):
        if np.size(i) > 1 and np.size(i) * _AFFINE_SHARE > size:
            return None
        fit = _affine(i, len(shape))
        if fit is None:
            return None
        base += step * fit[0]
        strides = [t + step * c for t, c in zip(strides, fit[1])]
    item = arr.itemsize
    return as_strided(arr.reshape(-1)[base:], shape, [t * item for t in strides],
                      writeable=False)


class _Getter:
    """A node's value for one env, computed on first use and kept (`Bound.evaluate`). A
    class rather than a recursive closure: a closure calling itself is a reference
    cycle, which keeps every tile it computed alive until the garbage collector runs."""

    def __init__(self, bound, env, tile=None, reuse=False, prescaled=False):
        self.bound, self.env, self.tile, self.vals = bound, env, tile, {}
        self.relative = bound.relative if tile is not None else ()
        self.heads = None
        if self.relative:   # the caller's key for its batch row and heads, else worked out
            self.heads = env.get("heads") or (int(env["b"]), tuple(np.ravel(env["h"])))
        self.diagonal = None
        self.reuse = reuse
        if prescaled:                            # the scaled score: that node's value
            self.vals[bound.score_factor[0]] = env["score"]

    def __call__(self, n):
        k = id(n)
        v = self.vals.get(k)
        if v is None:
            bound = self.bound
            if k in self.relative:
                key = (bound.values_key, bound.node_index[k], self.tile, self.heads)
                v = bound.diagonals.get(key)
                if v is None:
                    if self.diagonal is None:
                        self.diagonal = bound._diagonals(self.env, self.tile)
                    v = _toeplitz(self.diagonal(n), self.tile)
                    if len(bound.diagonals) >= _DIAGONALS_KEPT:
                        bound.diagonals.clear()
                    bound.diagonals[key] = v
            elif not n.args:                     # an argument or a constant
                v = bound._node(n, (), self.env)
            else:
                args = [self(a) for a in n.args]
                v = bound._node(n, args, self.env, self._spare(n, args) if self.reuse else None)
            self.vals[k] = v
        return v

    def _spare(self, n, args):
        """A tile among n's arguments that n's float result may overwrite (the candidates
        `Bound.spares` names): of the result's shape and the accumulation dtype,
        writeable, computed here (owned) — or the score where `reuse` is "score"; None if
        there is none."""
        acc = self.bound.acc_t
        for i, score in self.bound.spares.get(id(n), ()):
            x = args[i]
            if not (type(x) is np.ndarray and x.dtype == acc and x.flags.writeable
                    and (self.reuse == "score" if score else x.flags.owndata)):
                continue
            if n.op == "call" and any(type(y) is np.ndarray and y.dtype != acc for y in args):
                return None                      # the ufunc's own result dtype: kept as is
            if all(y is x or np.ndim(y) == 0 or _broadcasts_into(np.shape(y), x.shape)
                   for y in args):
                return x
        return None


def _times(g, d):
    """g · d, into d where d is a tile of g's shape and dtype: made for this product, or
    (exp's derivative) the node's own value, which no rule reads after its own (the
    reverse pass visits a node after every node that reads it)."""
    if type(d) is np.ndarray and d.flags.owndata and d.shape == np.shape(g) and \
            d.dtype == np.result_type(g, d):
        return np.multiply(g, d, out=d)
    return g * d


def _one_and_square(x, sign):
    """1 + sign·x², in one new tile (tanh's and tan's derivatives)."""
    t = np.square(x)
    if type(t) is not np.ndarray:
        return 1 + sign * t
    return (np.add if sign > 0 else np.subtract)(1, t, out=t)


def _scaled(g, f):
    """The adjoint tile g times its carried constant factor f."""
    return g if f == 1.0 else g * f


def _broadcasts_into(shape, into):
    """Whether an array of `shape` broadcasts to `into` (np.broadcast_shapes costs µs)."""
    return len(shape) <= len(into) and all(
        s == 1 or s == t for s, t in zip(reversed(shape), reversed(into)))


class _Values:
    """The values of a node's arguments, each computed when a rule first reads it."""

    def __init__(self, val, args):
        self.val, self.args = val, args

    def __getitem__(self, i):
        return self.val(self.args[i])


def _rule(n, a, y, g):
    """(argument node, its adjoint) pairs of node n with argument values a (`_Values`),
    its value y() and adjoint g; each adjoint a function, called only for the arguments
    the caller wants (adjoints keep the tile's shape: only the score and the buffers take
    them)."""
    op, args = n.op, n.args
    if op == "cast":                                  # float(x) of a float: identity
        return [(args[0], lambda: g)] if args[0].kind == FLOAT else []
    if op == "neg":
        return [(args[0], lambda: -g)]
    if op == "add":
        return [(args[0], lambda: g), (args[1], lambda: g)]
    if op == "sub":
        return [(args[0], lambda: g), (args[1], lambda: -g)]
    if op == "mul":
        return [(args[0], lambda: g * a[1]), (args[1], lambda: g * a[0])]
    if op == "div":
        return [(args[0], lambda: g / a[1]), (args[1], lambda: -g * y() / a[1])]
    if op == "pow":
        def dbase():
            return g * a[1] * a[0] ** (a[1] - 1)

        def dexp():
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.where(g == 0, 0, g * y() * np.log(a[0]))
        return [(args[0], dbase)] + ([(args[1], dexp)] if args[1].op != "const" else [])
    if op == "floordiv":
        return []
    if op == "mod":                                   # a − b·floor(a/b)
        return [(args[0], lambda: g), (args[1], lambda: -g * np.floor_divide(a[0], a[1]))]
    if op == "where":
        return [(args[1], lambda: np.where(a[0], g, 0)), (args[2], lambda: np.where(a[0], 0, g))]
    if op != "call":
        return []
    f = n.value
    if f in ("minimum", "maximum"):
        def first():                                  # ties: the first
            return (a[0] <= a[1]) if f == "minimum" else (a[0] >= a[1])
        return [(args[0], lambda: np.where(first(), g, 0)),
                (args[1], lambda: np.where(first(), 0, g))]
    if f == "clip":
        return [(args[0], lambda: np.where((a[0] >= a[1]) & (a[0] <= a[2]), g, 0)),
                (args[1], lambda: np.where(a[0] < a[1], g, 0)),
                (args[2], lambda: np.where(a[0] > a[2], g, 0))]
    d = {"exp": y, "exp2": lambda: y() * math.log(2), "expm1": lambda: y() + 1,
         "log": lambda: 1 / a[0], "log2": lambda: 1 / (a[0] * math.log(2)),
         "log10": lambda: 1 / (a[0] * math.log(10)), "log1p": lambda: 1 / (1 + a[0]),
         "sqrt": lambda: 0.5 / y(), "tanh": lambda: _one_and_square(y(), -1), "sinh": lambda: np.cosh(a[0]),
         "cosh": lambda: np.sinh(a[0]), "sin": lambda: np.cos(a[0]), "cos": lambda: -np.sin(a[0]),
         "tan": lambda: _one_and_square(y(), 1), "arctan": lambda: 1 / (1 + a[0] * a[0]),
         "abs": lambda: np.sign(a[0]), "square": lambda: 2 * a[0]}.get(f)
    if d is None:                                     # floor, ceil, trunc, sign: flat
        return []
    return [(args[0], lambda: _times(g, d()))]

