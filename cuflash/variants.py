"""Attention variants: the options that change the score tile, in one record.

Every variant enters at one place, the score tile, in this order (docs/api.md):

    s = scale·q·kᵀ → softcap → + ALiBi + bias → causal/window/mask → softmax (lse)
      → dropout → ·V

`Variants` carries the checked, normalised options from `cuflash.api` to a backend:
arrays in the compact 4-D form every backend reads (each axis full or 1, a size-1 axis
read with stride 0, never expanded), the window as two ints, the dropout threshold.
`Variants.is_plain()` says whether a call has none of them (a backend then gets no
variants at all).

Dropout draws its keep decision from a counter-based generator, Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), so it depends only
on (seed, b, h, i, j): every backend, every tiling, and the backward draw the same mask.
The mapping, here and in `cuflash/kernels/philox.cuh`:

    key     = (seed mod 2^32, seed div 2^32)
    counter = (j div 4, i, h, b)        b: flattened batch index, h: query head
    word    = output word j mod 4 of Philox4x32-10(counter, key)
    keep    = word >= floor(p · 2^32)   (so P(keep) = 1 − p to within 2^-32)

One Philox call serves four consecutive keys of a row.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# Philox4x32 constants (Random123, philox.h): the two multipliers and the Weyl key bumps.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_LO32 = np.uint64(0xFFFFFFFF)
# Philox blocks per chunk of a keep tile, whose uint64 state (8 bytes a block, a few arrays
# alive) should stay in L2 without making many NumPy calls, each a GIL hand-over between
# workers. On a 2-core Zen 5 (1 MB L2), N = 2048, p = 0.1, the dropout forward (2048 × 256
# tiles: 131 072 blocks) took 208–217 ms drawn whole, 151–155 in chunks of 65 536 (plain
# 45); 32 768 read 166–207, 8192 240 (one worker alone, 8192 is the quickest: 0.57 ms for
# a 512 × 256 tile against 1.1 whole).
_PHILOX_BLOCKS = 65536
_SHIFT32 = np.uint64(32)


# -- Philox4x32-10 ---------------------------------------------------------------------

def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-`rounds` of broadcastable uint32 arrays counter (c0, c1, c2, c3) and
    the key (k0, k1), two ints. Returns the four output words as uint32 arrays.

    One round: (hi0, lo0) = M0·c0, (hi1, lo1) = M1·c2 (64-bit products),
    c ← (hi1 ⊕ c1 ⊕ k0, lo1, hi0 ⊕ c3 ⊕ k1, lo0); then the key is bumped by (W0, W1).
    """
    return tuple(c.astype(np.uint32) for c in _philox_words(counter, key, rounds))


def _philox_words(counter, key, rounds):
    """philox4x32's words as uint64 arrays. A round's arrays are made by its products and
    the xors' broadcasts, the rest is in place: 1.2× faster on a 512 × 256 tile than a
    new array per operation (the keep masks are most of dropout's cost on the CPU)."""
    # (at least 1-D: a 0-d array's products are scalars, which take no `out`)
    c0, c1, c2, c3 = (np.atleast_1d(np.asarray(c, np.uint64)) for c in counter)
    k0, k1 = key
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    for r in range(rounds):
        if r:  # the key schedule: bumped between rounds (uint32 wrap-around)
            k0, k1 = (k0 + PHILOX_W0) & 0xFFFFFFFF, (k1 + PHILOX_W1) & 0xFFFFFFFF
        p0 = m0 * c0            # < 2^64: exact in uint64
        p1 = m1 * c2
        c0 = np.bitwise_xor(p1 >> _SHIFT32, c1)
        c0 ^= np.uint64(k0)
        c2 = np.bitwise_xor(p0 >> _SHIFT32, c3)
        c2 ^= np.uint64(k1)
        c1 = np.bitwise_and(p1, _LO32, out=p1)
        c3 = np.bitwise_and(p0, _LO32, out=p0)
    if all(np.ndim(c) == 0 for c in counter):
        return tuple(c.reshape(()) for c in (c0, c1, c2, c3))
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """floor(p · 2^32): a draw below it drops the entry. 0 for p = 0 (nothing dropped)."""
    return int(math.floor(float(p) * 2.0 ** 32))


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key of a seed: its low and high 32-bit words."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def keep_mask(seed: int, threshold: int, b, h, i, j):
    """The keep decision for broadcastable index arrays b, h, i, j (see module docstring).

    Draws one Philox block per distinct (j div 4, i, h, b), so a row's keys j0..j1 cost
    (j1 − j0)/4 + 1 blocks: pass j as a contiguous last axis for that to hold.
    """
    b, h, i, j = np.broadcast_arrays(*(np.asarray(x, np.int64) for x in (b, h, i, j)))
    if j.size == 0:
        return np.zeros(j.shape, bool)
    words = philox4x32((j >> 2, i, h, b), seed_key(seed))
    word = np.choose(j & 3, words)
    return word >= np.uint32(threshold) if threshold else np.ones(j.shape, bool)


def keep_tile(seed: int, threshold: int, b, h, i0: int, i1: int, j0: int, j1: int):
    """The keep mask of query rows [i0, i1) × keys [j0, j1), for batch index b and query
    heads h (ints or 1-D arrays, broadcast against each other as a leading axis):
    shape h.shape + (i1 − i0, j1 − j0). One Philox block per 4 keys."""
    h = np.atleast_1d(np.asarray(h, np.int64))
    b = np.broadcast_to(np.asarray(b, np.int64), h.shape)
    q0, q1 = j0 >> 2, (j1 + 3) >> 2
    jq = np.arange(q0, q1, dtype=np.int64)
    # (heads, rows, blocks, 4) → (heads, rows, 4·blocks): key 4·jq + w in order; each
    # word compared straight into its place, the rows in chunks of about _PHILOX_BLOCKS
    # blocks
    keep = np.empty((h.shape[0], i1 - i0, q1 - q0, 4), bool)
    step = max(1, _PHILOX_BLOCKS // (h.shape[0] * max(1, q1 - q0)))
    for a in range(i0, i1, step):
        ii = np.arange(a, min(a + step, i1), dtype=np.int64)
        ctr = (jq[None, None, :], ii[None, :, None], h[:, None, None], b[:, None, None])
        out = keep[:, a - i0:a - i0 + ii.size]
        for w, word in enumerate(_philox_words(ctr, seed_key(seed), PHILOX_ROUNDS)):
            np.greater_equal(word, np.uint64(threshold), out=out[..., w])
    return keep.reshape(h.shape[0], i1 - i0, 4 * (q1 - q0))[:, :, j0 - 4 * q0:j1 - 4 * q0]


def dropout_mask(shape, dropout_p, seed):
    """The boolean keep mask (True = kept) that dropout with `dropout_p` and `seed` uses
    for attention of shape (B, H, Nq, Nk): entry [b, h, i, j] for batch b, query head h,
    query i, key j. Identical on every backend and for every tiling; for testing and
    debugging (it is O(B·H·Nq·Nk))."""
    from . import _checks
    shape = tuple(shape)
    if len(shape) != 4 or any(isinstance(n, (bool, np.bool_)) or int(n) != n or n < 0
                              for n in shape):
        raise ValueError(f"shape must be (B, H, Nq, Nk), four ints >= 0; got {shape!r}")
    p, seed = _checks.check_dropout(dropout_p, seed)
    B, H, Nq, Nk = (int(n) for n in shape)
    t = dropout_threshold(p)
    out = np.empty((B, H, Nq, Nk), bool)
    if H and Nq and Nk:
        for b in range(B):
            out[b] = keep_tile(seed, t, b, np.arange(H), 0, Nq, 0, Nk)
    return out


# -- which keys a row sees (causal and window: index predicates) -------------------------

def key_bounds(i, Nq: int, Nk: int, causal: bool, window):
    """[lo, hi] (inclusive) of the keys query i may see by causal and window alone,
    bottom-right aligned: i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right, each side
    unbounded for −1, causal capping right at 0. Not clipped to [0, Nk)."""
    off = Nk - Nq
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    big = Nq + Nk + 1  # farther than any key: unbounded
    lo = i + off - (left if left >= 0 else big)
    hi = i + off + (right if right >= 0 else big)
    return lo, hi


# -- the record a backend receives ----------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Variants:
    """The checked options of one call, as backends read them.

    bias, mask: None or 4-D (B or 1, Hq or 1, Nq or 1, Nk or 1) arrays on the backend's
    device (a size-1 axis is broadcast: read with stride 0). alibi: None or (B or 1, Hq)
    slopes in the accumulation dtype. window: None or (left, right), −1 = unbounded.
    """

    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: object = None
    bias: object = None
    mask: object = None
    dropout_p: float = 0.0
    seed: int = 0
    # dropout's batch index b of batch row 0: a varlen sequence's index in the NumPy
    # backend's per-sequence calls (the kernels read it from their launch, and take 0)
    batch0: int = 0
    # the mods' kv_idx of key 0: a KV cache chunk's first key in the NumPy backend's
    # per-chunk calls (the kernels read the whole cache, and take 0)
    kv0: int = 0
    # programmable attention (cuflash.programmable): translated Mods and a BlockMask
    score_mod: object = None
    mask_mod: object = None
    block_mask: object = None

    def is_plain(self) -> bool:
        """True when no option is set: plain softmax(scale·q·kᵀ)·v (with causal or not)."""
        return self.active() == ()

    def active(self) -> tuple[str, ...]:
        """The names (API argument names) of the options set."""
        names = []
        if self.window is not None:
            names.append("window")
        if self.softcap is not None:
            names.append("softcap")
        if self.alibi is not None:
            names.append("alibi_slopes")
        if self.bias is not None:
            names.append("bias")
        if self.mask is not None:
            names.append("mask")
        if self.dropout_p > 0:
            names.append("dropout_p")
        names += [n for n in ("score_mod", "mask_mod", "block_mask")
                  if getattr(self, n) is not None]
        return tuple(names)

    @property
    def threshold(self) -> int:
        return dropout_threshold(self.dropout_p)

    @property
    def keep_scale(self) -> float:
        """1/(1 − p): what a kept entry is multiplied by."""
        return 1.0 / (1.0 - self.dropout_p)


PLAIN = Variants()


def unsupported(variants, backend: str, supported_by: str = "numpy"):
    """ValueError for options a backend does not take yet (never a silent wrong answer)."""
    names = ", ".join(variants.active())
    return ValueError(f"{names} {'is' if len(variants.active()) == 1 else 'are'} not "
                      f"supported by backend={backend!r} yet; backend={supported_by!r} "
                      f"supports {'it' if len(variants.active()) == 1 else 'them'}")
