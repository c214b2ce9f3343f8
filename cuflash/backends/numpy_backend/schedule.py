"""Which blocks the tiled loops visit, how a causal block is masked, and how the
heads are cut into pool tasks: the mask logic and the work split, in one place."""
import functools

import numpy as np

NEG_INF = -np.inf

# Blocks start on multiples of 16 keys (rows for outer="k"), one 64-byte cache
# line of float32, rather than right at the diagonal: the unmasked blocks and
# the K/V slices then start aligned (odd offsets measured ~10% slower).
ALIGN = 16


def block_schedule(Nq, Nk, Br, Bc, *, causal, outer="q", diag=None):
    """The blocks a tiled loop visits.

    outer="q" (the forward): yields (r0, r1, steps) for each Q tile of Br rows;
    outer="k" (the backward, FA1): yields (c0, c1, steps) for each K/V tile of
    Bc keys. A step (r0, r1, c0, c1, t) is the block rows [r0, r1) × keys
    [c0, c1), inside the tile; t is None where every row of the block sees
    every key of it, else the block straddles the causal diagonal (key j hidden
    from query i when j > i + Nk − Nq) and key c0+b is hidden from row r0+a
    exactly when b − a > t, t = r0 + Nk − Nq − c0 (`mask_block`).

    With causal=True a Q tile's keys split into unmasked full-height blocks
    (Bc keys at a time) up to about the tile's first row, then the Br × Br
    triangle the diagonal crosses (outer="k": a K/V tile's rows, the other way
    round). That triangle is cut into key strips of `diag` keys, each computing
    only the rows that can see its keys: about (1 + 1/n)/2 of the triangle for
    n strips, instead of all of it. Big tiles stay where there is no mask (they
    reuse K/V from cache and amortise the per-tile work; 128-row tiles throughout
    measured 30% slower). A tile no row sees has steps = [].
    """
    off = Nk - Nq
    diag = diag or (Br if outer == "q" else Bc)
    if outer == "q":
        for r0 in range(0, Nq, Br):
            r1 = min(r0 + Br, Nq)
            if not causal:
                yield r0, r1, [(r0, r1, c0, min(c0 + Bc, Nk), None) for c0 in range(0, Nk, Bc)]
                continue
            full = min(max(r0 + off + 1, 0), Nk)   # keys 0 .. full−1: seen by every row
            full -= full % ALIGN
            steps = [(r0, r1, c0, min(c0 + Bc, full), None) for c0 in range(0, full, Bc)]
            end = min(max(r1 + off, 0), Nk)        # keys past end−1: seen by no row of the tile
            for b0 in range(full, end, diag):      # the triangle, in key strips
                b1 = min(b0 + diag, end)
                lo = min(max(b0 - off, r0), r1)    # rows before lo see no key of the strip
                lo -= (lo - r0) % ALIGN
                steps.append((lo, r1, b0, b1, lo + off - b0))
            yield r0, r1, steps
    elif outer == "k":
        for c0 in range(0, Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            if not causal:
                yield c0, c1, [(r0, min(r0 + Br, Nq), c0, c1, None) for r0 in range(0, Nq, Br)]
                continue
            hi = min(max(c1 - 1 - off, 0), Nq)     # rows from hi on see every key of the tile
            hi = min(hi + (-hi) % ALIGN, Nq)
            steps = []
            for b0 in range(c0, c1, diag):         # the triangle, in key strips
                b1 = min(b0 + diag, c1)
                lo = min(max(b0 - off, 0), Nq)     # rows before lo see no key of the strip
                if hi > lo:
                    steps.append((lo, hi, b0, b1, lo + off - b0))
            steps += [(r0, min(r0 + Br, Nq), c0, c1, None) for r0 in range(hi, Nq, Br)]
            yield c0, c1, steps
    else:
        raise ValueError(f"outer must be 'q' or 'k'; got {outer!r}")


@functools.lru_cache(maxsize=256)
def _hidden(rows, cols, t):
    """True where b − a > t in a (rows, cols) block (read-only, cached: a few shapes recur)."""
    mask = np.triu(np.ones((rows, cols), bool), k=t + 1)
    mask.flags.writeable = False
    return mask


def mask_block(S, G, rows, t, fill=NEG_INF):
    """Write `fill` (−inf: a hidden score; 0: a hidden probability) into the hidden
    entries of S (nh, G·rows, w) or (nh, G, rows, w), a block straddling the
    diagonal (b − a > t hidden). Only the corner that holds hidden entries is
    touched: columns b > t and rows a < w − 1 − t."""
    nh, w = S.shape[0], S.shape[-1]
    b0 = max(0, t + 1)
    b0 -= b0 % ALIGN
    a1 = min(rows, max(0, w - 1 - t))
    if b0 < w and a1 > 0:
        np.copyto(S.reshape(nh, G, rows, w)[:, :, :a1, b0:], fill,
                  where=_hidden(a1, w - b0, t - b0))


def tile_rows(rows, G, Nq):
    """Br, the rows per query head of a tile of about `rows` stacked rows (G heads)."""
    return max(1, min(Nq, rows // G)) if G <= rows else 1


def head_chunks(BH, per_head, budget, workers):
    """Split the B·Hkv K/V heads into ranges whose tiles fit `budget` (per_head: one
    head's share, in the budget's units), with at least one range per worker when
    there are enough heads (small N)."""
    hc = max(1, min(BH, budget // max(1, per_head)))
    hc = min(hc, max(1, BH // workers))
    return [(h, min(h + hc, BH)) for h in range(0, BH, hc)]


def head_ranges(BH, workers):
    """B·Hkv heads cut into one contiguous range per worker, for the per-call
    preparation of the backward and of the variants: a few NumPy calls over many heads
    rather than many calls over one (with two workers every call hands the GIL over;
    measured 2× faster at N = 512)."""
    n = min(BH, workers)
    cuts = [BH * i // n for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]
