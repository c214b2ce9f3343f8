"""The range of every integer node of a mod, from the ranges of its arguments.

`int_ranges` runs interval arithmetic over the tree: b, h, q_idx and kv_idx are bounded
by the call's sizes, constants by themselves, a captured integer array by its smallest
and largest entry. A node whose range is known fits or does not fit 32 bits, so the NumPy
evaluation can take int32 where no value can overflow it (half the memory traffic of
int64, the same results), and an index whose range lies inside its array needs no
run-time bounds check. A range that cannot be bounded (an integer from a float, a
division by a range that holds 0) is None, and everything computed from it.
"""
INT32 = (-2 ** 31, 2 ** 31 - 1)


def int_ranges(order, arg_ranges, buffer_ranges):
    """{id(node): (lo, hi) or None} of the integer nodes of `order` (a tree's walk, the
    arguments first): arg_ranges {"b": (lo, hi), ...}, buffer_ranges {name: (lo, hi)}
    for the captured integer arrays."""
    out = {}
    for n in order:
        if n.kind != "int":
            continue
        a = [out.get(id(x)) if x.kind == "int" else _bool_range(x) for x in n.args]
        out[id(n)] = None if any(r is None for r in a) else _range(n, a, arg_ranges,
                                                                     buffer_ranges)
    return out


def fits_int32(r):
    return r is not None and INT32[0] <= r[0] and r[1] <= INT32[1]


def _bool_range(node):
    return (0, 1) if node.kind == "bool" else None


def _range(n, a, arg_ranges, buffer_ranges):
    op = n.op
    if op == "const":
        return (n.value, n.value)
    if op == "arg":
        return arg_ranges.get(n.value)
    if op == "index":
        return buffer_ranges.get(n.value)
    if op == "cast":
        return a[0] if n.args[0].kind != "float" else None
    if op == "add":
        return (a[0][0] + a[1][0], a[0][1] + a[1][1])
    if op == "sub":
        return (a[0][0] - a[1][1], a[0][1] - a[1][0])
    if op in ("mul", "floordiv"):
        if op == "floordiv" and a[1][0] <= 0 <= a[1][1]:
            return None
        f = (lambda x, y: x * y) if op == "mul" else (lambda x, y: x // y)
        c = [f(x, y) for x in a[0] for y in a[1]]
        return (min(c), max(c))
    if op == "mod":
        lo, hi = a[1]
        if lo > 0:
            return a[0] if 0 <= a[0][0] and a[0][1] < lo else (0, hi - 1)
        if hi < 0:
            return (lo + 1, 0)
        return None
    if op == "pow":  # a constant exponent ≥ 0 (translate)
        return _power(a[0], a[1][0])
    if op == "neg":
        return (-a[0][1], -a[0][0])
    if op == "invert":
        return (~a[0][1], ~a[0][0])
    if op in ("and", "or", "xor"):
        if a[0][0] < 0 or a[1][0] < 0:
            return None
        if op == "and":
            return (0, min(a[0][1], a[1][1]))
        return (0, (1 << max(a[0][1], a[1][1]).bit_length()) - 1)
    if op in ("lshift", "rshift"):
        if a[1][0] < 0 or a[1][1] > 62:
            return None
        f = (lambda x, s: x << s) if op == "lshift" else (lambda x, s: x >> s)
        c = [f(x, s) for x in a[0] for s in a[1]]
        return (min(c), max(c))
    if op == "where":
        return (min(a[1][0], a[2][0]), max(a[1][1], a[2][1]))
    if op == "call":
        f = n.value
        if f == "abs":
            lo, hi = a[0]
            return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
        if f == "square":
            return _power(a[0], 2)
        if f == "sign":
            return (-1 if a[0][0] < 0 else 0 if a[0][0] == 0 else 1,
                    1 if a[0][1] > 0 else 0 if a[0][1] == 0 else -1)
        if f in ("minimum", "maximum"):
            g = min if f == "minimum" else max
            return (g(a[0][0], a[1][0]), g(a[0][1], a[1][1]))
        if f == "clip":  # minimum(maximum(x, lo), hi)
            m = (max(a[0][0], a[1][0]), max(a[0][1], a[1][1]))
            return (min(m[0], a[2][0]), min(m[1], a[2][1]))
    return None


def _power(r, e):
    c = [x ** e for x in r] + ([0] if r[0] < 0 < r[1] else [])
    return (min(c), max(c))
