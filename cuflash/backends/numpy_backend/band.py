"""A band's tiles in runs: consecutive tiles of one shape on one diagonal, computed at once.

Under a window every Q tile of Br rows away from the sequence's ends is one step over the
same span of keys, shifted by Br keys from the tile before (and every K/V tile of Bc keys
one step over the same span of rows, shifted by Bc rows). A run stacks n such tiles into
one array, (n, G·Br, span) in the forward: its keys are n overlapping windows of K,
strided views of K's own memory, so one batched matmul (and one NumPy call per softmax
pass) serves n tiles. A tile's NumPy calls, not its scores, are what small tiles cost; in
runs a band can take tiles of a few rows, whose span Br + w is near the band's own w.
Pool tasks take batches of runs, so the tiles the sequence's ends clip share one task.
"""
from numpy.lib.stride_tricks import as_strided


def runs(schedule, G, budget):
    """(r0, rows, n, steps) from a schedule's tiles (r0, r1, steps): n consecutive tiles
    of `rows` rows, tile i at rows r0 + i·rows and keys c0 + i·rows for each step (c0,
    c1, pred) of tile 0. Only one-step tiles of one shape and one offset from the
    diagonal are merged, as many as `budget` scores of G heads hold."""
    out = []
    for r0, r1, steps in schedule:
        if out and _extends(out[-1], r0, r1, steps):
            p0, rows, n, first = out[-1]
            if G * (n + 1) * rows * (first[0][1] - first[0][0]) <= budget:
                out[-1] = (p0, rows, n + 1, first)
                continue
        out.append((r0, r1 - r0, 1, steps))
    return out


def _extends(run, r0, r1, steps):
    """Whether the tile (r0, r1, steps) is the next block of `run`."""
    p0, rows, n, first = run
    if len(steps) != 1 or len(first) != 1 or r1 - r0 != rows or r0 != p0 + n * rows:
        return False
    (c0, c1, pred), (f0, f1, f_pred) = steps[0], first[0]
    return pred == f_pred and c0 - r0 == f0 - p0 and c1 - c0 == f1 - f0


def batches(runs, G, budget):
    """Consecutive runs grouped into pool tasks of at most `budget` scores of G heads (a
    run may exceed it alone): the tiles the sequence's ends clip, each a run of its own,
    then share one task's fixed cost."""
    out, size = [], budget
    for run in runs:
        _, rows, n, steps = run
        scores = G * n * rows * sum(c1 - c0 for c0, c1, _ in steps)
        if out and size + scores <= budget:
            out[-1].append(run)
            size += scores
        else:
            out.append([run])
            size = scores
    return out


def windows(x, n, shift, size, axis=0):
    """Read-only view of x with n windows along `axis`, window i = x[…, i·shift :
    i·shift + size, …], the window index first: (n, …, size, …)."""
    if n == 1:  # a slice: as_strided takes ~7 µs, a tenth of a small step's time
        return x[(None,) + (slice(None),) * axis + (slice(0, size),)]
    s = x.strides
    return as_strided(x, (n,) + x.shape[:axis] + (size,) + x.shape[axis + 1:],
                      (shift * s[axis],) + s, writeable=False)


def diagonal_windows(x, n, shift, rows, cols):
    """Read-only view (n, …, rows, cols) of x (…, rows', cols'): block i = x[…, i·shift
    : i·shift + rows, i·shift : i·shift + cols] (a bias or mask under a run's blocks)."""
    if n == 1:
        return x[..., :rows, :cols][None]
    s = x.strides
    return as_strided(x, (n,) + x.shape[:-2] + (rows, cols),
                      (shift * (s[-2] + s[-1]),) + s, writeable=False)
