"""The expression a score_mod or mask_mod becomes: a small typed tree.

`translate` reads the user's Python function into one `Node` tree; every target reads
that tree — the vectorised NumPy evaluation and its reverse-mode gradient (`evaluate`),
and the specialization cache key (`Node.key`). Helper functions are inlined and local
names substituted, so the tree is one expression of the call's arguments, constants and
captured arrays.

A node's kind is one of FLOAT, INT, BOOL: FLOAT is the accumulation dtype (float32 for
16-bit and float32 inputs, float64 for float64), INT a 64-bit integer on the CPU,
BOOL a truth value. Arithmetic on INT and FLOAT gives FLOAT, as in Python.
"""
FLOAT, INT, BOOL = "float", "int", "bool"

# The arguments, in the order score_mod takes them (mask_mod takes the last four).
ARGS = ("score", "b", "h", "q_idx", "kv_idx")
ARG_KINDS = {"score": FLOAT, "b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}

# Elementwise functions of floats, by their NumPy names, with the derivative rules in
# `evaluate`. Python's math module spells them the same (`math.exp`, ...).
FLOAT_FUNCS = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "tanh",
               "sinh", "cosh", "sin", "cos", "tan", "arctan", "floor", "ceil", "trunc")
# Functions whose result keeps the kind of their (promoted) arguments.
KIND_FUNCS = ("abs", "square", "sign", "minimum", "maximum", "where", "clip")


class Node:
    """One operation of the tree: op, its argument nodes, its kind; `value` is the
    constant (op "const"), the argument's name ("arg"), the function's name ("call"),
    the buffer's name ("index") or the target kind ("cast"). `where` is the line of the
    user's source it came from, for error messages."""

    __slots__ = ("op", "args", "kind", "value", "where", "_key")

    def __init__(self, op, args, kind, value=None, where=""):
        self.op, self.args, self.kind, self.value, self.where = op, tuple(args), kind, value, where
        self._key = None

    def key(self):
        """A canonical string of the tree: equal for equal expressions, whatever their
        source lines (the specialization cache key)."""
        if self._key is None:
            head = self.op if self.value is None else f"{self.op}:{self.value!r}"
            self._key = f"{head}/{self.kind}(" + ",".join(a.key() for a in self.args) + ")"
        return self._key

    def walk(self):
        """Every node once, arguments before the nodes that use them (a shared subtree,
        from a local name used twice, once)."""
        seen, order = set(), []

        def visit(n):
            if id(n) in seen:
                return
            seen.add(id(n))
            for a in n.args:
                visit(a)
            order.append(n)

        visit(self)
        return order

    def __repr__(self):
        return f"Node({self.key()})"
